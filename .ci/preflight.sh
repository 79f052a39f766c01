#!/usr/bin/env bash
# Before CI's tests: what the machine looks like (read back when a run fails for reasons of its
# own), the services the tests need started when a session left one stopped, and the broker freed
# of queues that earlier test and bench runs left behind (their prefixes are random per run).
set -uo pipefail

echo "== preflight $(date -u +%FT%TZ): $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
free -m | awk 'NR==2 {print "   memory: " $7 " MiB available of " $2}'
df -h / | awk 'NR==2 {print "   disk: " $4 " free of " $2}'

listening() { timeout 2 bash -c "</dev/tcp/127.0.0.1/$1" 2>/dev/null; }

start_if_down() {  # port, name, start command...
    local port=$1 name=$2
    shift 2
    if listening "$port"; then
        echo "   $name: listening on $port"
        return
    fi
    echo "   $name: nothing on $port, starting it"
    "$@" >/dev/null 2>&1 || true
    for _ in $(seq 60); do listening "$port" && { echo "   $name: up"; return; }; sleep 1; done
    echo "   $name: still down after 60 s (its tests will fail)"
}

start_if_down 5432 PostgreSQL bash -c 'pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start'
start_if_down 6379 Redis redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
# A node whose app was stopped (rabbitmqctl stop_app) keeps running without its AMQP listener.
start_if_down 5672 RabbitMQ bash -c 'rabbitmqctl start_app || rabbitmq-server -detached'

if command -v rabbitmqctl >/dev/null; then
    timeout 60 rabbitmq-diagnostics alarms 2>&1 | tail -1 | sed 's/^/   /'
    # A run's queues share its prefix (up to the first dot); a prefix none of whose queues has a
    # consumer belongs to a stack that is gone.
    leftovers=$(timeout 60 rabbitmqctl list_queues name messages consumers --quiet 2>/dev/null | awk '
        $1 ~ /^sluice-(e2e|bench)-/ { split($1, part, "."); prefix[NR] = part[1]; name[NR] = $1; messages[NR] = $2; if ($3 > 0) live[part[1]] = 1 }
        END { for (i in name) if (!(prefix[i] in live)) print name[i], messages[i] }')
    if [ -n "$leftovers" ]; then
        echo "   deleting $(echo "$leftovers" | wc -l) queues left by earlier test and bench runs ($(echo "$leftovers" | awk '{s += $2} END {print s + 0}') messages)"
        echo "$leftovers" | awk '{print $1}' | while read -r queue; do
            timeout 30 rabbitmqctl delete_queue "$queue" </dev/null >/dev/null 2>&1
        done
    fi
fi
exit 0
