"""Iteration-level (continuous) batching engine: the public API, no I/O.

A caller (the scheduler) decides each iteration which sequences join
(PrefillRow), advance (DecodeRow) or leave (ReleaseRow); `step` runs all
token-producing rows through one batched forward pass and samples one token
for each.

Chunked prefill: a PrefillRow with `chunk` > 0 caches at most that many prompt
tokens in its step, and each later DecodeRow of the sequence caches the next
chunk, answering no token (token_id -1, finish "") until the whole prompt is
in; the step that caches the last chunk samples the first token. A step's cost
grows with the tokens it carries, so a long prompt cut into chunks stalls the
other sequences of the batch (and whoever waits for the step to end) for one
chunk at a time instead of for the whole prompt.

Prefill budget (`prefill_tokens_per_step`): a step computes at most that many prompt tokens; prompts
beyond wait, whole, for a later step (answering no token meanwhile, like a chunk), so a burst of
prompts answers its first tokens one step after another instead of all when the last is in. Decode
tokens do not count, and a step's first prompt always goes.

Shared slots: several schedulers (adapters) may drive one engine. A prefill that finds every
slot taken answers finish "busy" and changes nothing: the caller retries it later; it is
backpressure, not an error. A sequence not stepped (decoded, prefilled or released) for
`slot_lease_s`, while the engine ran at least LEASE_MIN_STEPS other steps, is released at the
next step unless that step names it, so the slots of a scheduler that died come back. (Time alone
is not enough: a live scheduler's step may wait that long behind another scheduler's large prefill.) Until then, a prefill
that finds every slot held by sequences none of which was stepped in the last LEASE_MIN_STEPS steps
answers finish "stale" instead of "busy": nothing changed either, but nobody is using the engine it
waits for (a live scheduler steps its sequences at nearly every step), so the replica cannot serve
and its health probe must not pass.
Prefix cache (prefix_cache.py): a finished or released sequence's slot keeps its KV cells until
a new sequence needs the slot, and a prompt that begins with tokens a slot holds (a cached one, or
a live sequence's, copied) prefills only the rest; its results report those tokens as
`cached_tokens`. Cached slots count as free: live work evicts them (least recently used first) and
never hears "busy" because of them.
Siblings (a request's n choices): prefill rows of one step with the same prompt, each cached
whole in the step, are prefilled once: the first is the leader, the others take a free slot, a copy
of the leader's KV cells once the forward pass has made them (llama_memory_seq_cp) and their first
token from the leader's logits, each with its own sampling options and random stream; their
`cached_tokens` is the whole prompt. Siblings that arrive in a later step find the leader live and
prefill only the prompt's last token (the prefix cache's live reuse).
Log-probabilities (Sampling.logprobs): each token's result carries a TokenLogprob (sampling.py says
which distribution they are of).
Each sequence records its `owner` (the scheduler that prefilled it) for the per-owner metrics.
Freed slots go to owners in the order they were turned away: while an owner that was answered
"busy" keeps asking, another owner's prefill does not take the slot it waits for (otherwise the
scheduler that frees a slot refills it at once and the other starves).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import gguf
import numpy as np

from sluice_common.sampling import Sampling, StructuredOutputs, StructuredOutputsError, field_error, problem

from .constraints import CompiledConstraint, ConstraintCompiler, Matcher, apply_masks, compute_masks
from .gguf_fast import open_reader
from .gguf_weights import load_weights, read_config
from .host_prefix_store import HostPrefixStore
from .model import BatchItem, LlamaModel, StepInterrupted
from .prefix_cache import MIN_REUSED_TOKENS, Cells, PrefixCache, common_prefix, exact_reuse
from .rows import DecodeRow, PrefillRow, ReleaseRow, Row, RowResult, TokenLogprob, TopLogprob
from .sampling import BatchSampler, RowLogprobs
from .stops import StopFilter
from .tokenizer import GGUFTokenizer, IncrementalDetokenizer

# Standard logging, as shared_engine's: Triton's image runs the engine without structlog.
log = logging.getLogger("sluice.triton_local.engine")
# Sequences one log line names at most (a step may fail a whole batch); the rest are counted.
MAX_LOGGED_SEQUENCES = 16


# Engine steps a sequence must have missed, besides the lease time, before it is released.
LEASE_MIN_STEPS = 16
# An owner turned away that has not asked again for this long no longer waits for a slot.
REFUSED_MEMORY_S = 1.0


@dataclass
class _Seq:
    seq_id: int
    slot: int
    params: Sampling
    prompt_tokens: int
    detok: IncrementalDetokenizer
    stopper: StopFilter
    pos: int = 0  # positions already in the KV cache
    chunk: int = 0
    uncached_prompt: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    cells: Cells = field(default_factory=Cells)  # what positions 0..pos-1 of its slot hold
    cached_tokens: int = 0  # prompt tokens it started with from the prefix cache
    last_token: int = -1  # sampled but not yet fed back
    completion_tokens: int = 0
    owner: str = ""
    request_id: str = ""  # its caller's request id (a prefill's "request_id"), for log lines
    matcher: Matcher | None = None  # its constraint's state, when it has one
    last_stepped_at: float = 0.0
    last_stepped_step: int = 0


@dataclass
class _Pending:
    """A token-producing row waiting for this step's forward pass."""

    row_index: int
    seq: _Seq
    item: BatchItem | None  # None: a sibling, fed from its leader's forward pass
    cancelled: bool = field(default=False)
    leader: _Pending | None = None  # a sibling's leader (same prompt, same step)
    deferred: bool = False  # a prompt left for a later step by the step's prefill budget

    @property
    def prompt(self) -> bool:
        """Its item carries prompt tokens (a prefill or its next chunk): no token made yet."""
        return self.item is not None and self.seq.completion_tokens == 0


class StepEngine:
    def __init__(
        self,
        gguf_path: str,
        max_slots: int = 8,
        max_context: int | None = None,
        *,
        engine: str = "llamacpp",
        threads: int = 1,
        gpu_layers: int = 0,
        main_gpu: int | None = None,
        low_memory: bool = False,
        slot_lease_s: float = 0.0,
        prefix_cache: bool = True,
        prefill_tokens_per_step: int = 0,
        host_prefix_bytes: int = 0,
        adaptive_threads: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """engine "llamacpp" runs the forward pass on llama.cpp (threads, gpu_layers, main_gpu apply);
        "numpy" on our own numpy model (BLAS threads are fixed when numpy is imported), where
        low_memory keeps one copy of each weight matrix (~0.6 GB instead of ~1.1 GB for
        SmolLM2-135M) at the cost of slower small-batch decode. slot_lease_s > 0: a sequence
        not stepped for that long is released at the next step (0: never). prefix_cache: free
        slots keep their KV cells for prompts that begin with the same tokens.
        prefill_tokens_per_step > 0: the prompt tokens one step computes (see `step`); 0: no bound.
        host_prefix_bytes > 0: cached prefixes evicted from their slot are kept in host memory up
        to that many bytes, for a later prompt to restore (host_prefix_store.py; llama.cpp only).
        adaptive_threads: llama.cpp on the CPU steps with fewer of its threads while another process
        takes cores (thread_governor.py)."""
        if max_slots < 1:
            raise ValueError("max_slots must be >= 1")
        if prefill_tokens_per_step < 0:
            raise ValueError("prefill_tokens_per_step must be >= 0 (0: no bound)")
        self.prefill_tokens_per_step = prefill_tokens_per_step
        reader = open_reader(gguf_path)
        self.config = read_config(reader)
        self.tokenizer = GGUFTokenizer(reader)
        ctx = self.config.context_length if max_context is None else min(max_context, self.config.context_length)
        if ctx < 2:
            raise ValueError("max_context must be >= 2")
        self._ctx = ctx
        self.max_slots = max_slots
        self.engine = engine
        self._model = _forward_model(engine, reader, gguf_path, max_slots, ctx, threads, gpu_layers, main_gpu, low_memory, adaptive_threads)
        self._threads = threads
        self._slots = PrefixCache(range(max_slots), enabled=prefix_cache)
        can_save = prefix_cache and hasattr(self._model, "save_state")
        self._host = HostPrefixStore(host_prefix_bytes if can_save else 0)
        self.host_restores_total = 0
        self._sampler = BatchSampler(max_slots, self.vocab_size)
        self._seqs: dict[int, _Seq] = {}
        self.tokens_generated_total = 0
        self._slot_lease_s = slot_lease_s
        self._clock = clock
        self._steps = 0
        self.slots_reclaimed_total = 0
        self.reclaimed_recently: deque[str] = deque(maxlen=16)  # described, until the server logs them
        self.steps_interrupted_total = 0
        # The prefix cache's effect: prefills, those that started from cached tokens, and those tokens.
        self.prefills_total = 0
        # Prompts a step's prefill budget left for a later step (each time one is).
        self.prefills_deferred_total = 0
        self.prefix_hits_total = 0
        self.cached_tokens_total = 0
        # This step's whole-prompt prefills by prompt: a later prefill of the same prompt is their sibling.
        self._leaders: dict[tuple[int, ...], _Pending] = {}
        # Owners answered "busy", in the order they were first turned away, with the last time.
        self._refused: dict[str, float] = {}
        self._constraints: ConstraintCompiler | None = None  # built on first use (~0.2 s)
        # Time spent computing and applying constraint masks, and the masks: their cost per token.
        self.constraint_mask_seconds_total = 0.0
        self.constraint_masks_total = 0

    @property
    def context_length(self) -> int:
        return self._ctx

    @property
    def vocab_size(self) -> int:
        """Token ids are 0..vocab_size-1 (the model's logits have one per id)."""
        return self.config.vocab

    @property
    def active_slots(self) -> int:
        return len(self._seqs)

    @property
    def threads_in_use(self) -> int:
        """The threads the next step computes with: fewer than configured while adaptive threads
        find the box busy (thread_governor.py)."""
        return getattr(self._model, "threads_in_use", self._threads)

    @property
    def prefix_reuse_bit_exact(self) -> bool:
        """Whether a prefix cache hit leaves a prompt's logits bit for bit those of its cold prefill
        (whole, alone in its step): llama.cpp on the CPU only (ForwardModel.reuse_bit_exact)."""
        return self._model.reuse_bit_exact

    @property
    def cached_slots(self) -> int:
        """Free slots that still hold a finished sequence's KV cells."""
        return self._slots.cached_slots

    @property
    def host_prefix_bytes(self) -> int:
        """Bytes of evicted prefixes held in host memory."""
        return self._host.bytes

    @property
    def host_store_capacity_bytes(self) -> int:
        """The host store's bound: 0 when off (asked for none, no prefix cache, or a forward pass
        that cannot save a slot's cells: the numpy engine)."""
        return self._host.capacity_bytes

    def close(self) -> None:
        """Frees the forward pass's memory outside Python's (llama.cpp's context and weights; the
        numpy model has none) and the host prefix store. Nothing may be stepped after."""
        close = getattr(self._model, "close", None)
        if close is not None:
            close()
        self._host.clear()

    def clear_prefix_cache(self) -> None:
        """Forgets every cached prefix (their slots stay free, the host store empty): the next prompts prefill cold."""
        for slot in self._slots.clear():
            self._model.release(slot)
        self._host.clear()

    def slots_by_owner(self) -> dict[str, int]:
        return dict(Counter(seq.owner for seq in self._seqs.values()))

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def apply_chat_template(self, messages: list[tuple[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def compile_constraint(self, constraint: StructuredOutputs) -> CompiledConstraint:
        """The constraint compiled against this model's vocabulary (cached): raises StructuredOutputsError
        naming the unsupported keyword or construct. A prefill compiles its row's constraint itself;
        a caller may compile first to refuse a request before it queues."""
        if self._constraints is None:
            self._constraints = ConstraintCompiler(self.tokenizer)
        return self._constraints.compile(constraint)

    def step(self, rows: list[Row], interruptible: bool = False) -> list[RowResult]:
        """One iteration. Rows are applied in order (a release frees its slot
        for a later prefill in the same call); one result per row, same order.
        Never raises for bad rows: they get finish_reason "error".

        `interruptible`: the step may be stopped midway by `interrupt()` (unless it prefills one
        prompt for several siblings). Its rows then answer no token (token_id -1, finish "", as a
        prompt chunk does) and change nothing but admissions: a decoding sequence stays as it was,
        and a prefill row's sequence is admitted with none of its prompt cached, which its next
        decode row caches (its chunk, or the whole prompt) as for a chunked prefill."""
        now = self._clock()
        self._steps += 1
        touched = {row.seq_id for row in rows}
        for seq in self._seqs.values():
            if seq.seq_id in touched:
                seq.last_stepped_at, seq.last_stepped_step = now, self._steps
        self._reclaim_expired(now)  # after: a sequence this step names has a live scheduler
        results: list[RowResult | None] = [None] * len(rows)
        pending: list[_Pending] = []
        self._leaders = {}
        for i, row in enumerate(rows):
            if isinstance(row, ReleaseRow):
                results[i] = self._release(row.seq_id, pending)
            elif isinstance(row, PrefillRow):
                p = self._admit_or_fail(i, row)
                if isinstance(p, RowResult):
                    results[i] = p
                else:
                    pending.append(p)
            elif isinstance(row, DecodeRow):
                p = self._queue_decode(i, row.seq_id, pending)
                if isinstance(p, RowResult):
                    results[i] = p
                else:
                    pending.append(p)
            else:
                results[i] = _error(getattr(row, "seq_id", -1), f"unknown row type {type(row).__name__}")

        for p in pending:
            if p.cancelled:
                results[p.row_index] = _error(p.seq.seq_id, "sequence was released in the same step", p.seq)
        for p in pending:
            if p.leader is not None and p.leader.cancelled and not p.cancelled:
                p.cancelled = True
                self._free(p.seq, keep_cells=False)
                results[p.row_index] = _error(p.seq.seq_id, "its prompt's leader was released in the same step", p.seq)
        self._defer_over_prefill_budget(pending, results)
        live = [p for p in pending if not p.cancelled and not p.deferred and p.item is not None]
        siblings = [p for p in pending if not p.cancelled and p.item is None]
        if live:
            try:
                logits = self._model.forward([p.item for p in live if p.item is not None], interruptible=interruptible and not siblings)
            except StepInterrupted:
                self.steps_interrupted_total += 1
                for p in live:
                    results[p.row_index] = _untouched(p)
            except Exception as exc:  # keep the engine usable; fail only this step's rows
                self._fail(live + siblings, f"forward pass failed: {exc!r}", results)
            else:
                try:
                    self._advance(live, siblings, logits, results)
                except Exception as exc:  # their sequences are half advanced: fail them as above
                    self._fail(live + siblings, f"sampling failed: {exc!r}", results)
        return results  # type: ignore[return-value]

    def _advance(self, live: list[_Pending], siblings: list[_Pending], logits: np.ndarray, results: list[RowResult | None]) -> None:
        """After the forward pass: the rows' cells, the siblings' copies, and a token for every row that makes one."""
        self._record_cells(live, siblings)
        self._sample_tokens(live, siblings, logits, results)

    def _record_cells(self, live: list[_Pending], siblings: list[_Pending]) -> None:
        # Which of each item's tokens ran attention's tiled kernel, as the forward pass says (a model
        # without such a kernel says nothing: exact_reuse then ignores the flags).
        tiled: list[list[bool]] | None = getattr(self._model, "last_tiled", None)
        for k, p in enumerate(live):
            assert p.item is not None
            p.seq.pos = p.item.start_pos + len(p.item.token_ids)
            p.seq.cells.append(p.item.token_ids, tiled[k] if tiled is not None else False)
        for p in siblings:  # the leader's cells, now that its forward pass made them
            assert p.leader is not None
            self._model.copy(p.leader.seq.slot, p.seq.slot)
            p.seq.pos = p.leader.seq.pos
            p.seq.cells = p.leader.seq.cells.prefix(p.leader.seq.pos)

    def _sample_tokens(self, live: list[_Pending], siblings: list[_Pending], logits: np.ndarray, results: list[RowResult | None]) -> None:
        row_of = {id(p): i for i, p in enumerate(live)}
        # One sampling call for every row that makes a token (a prefill still caching its
        # prompt's chunks makes none); a sibling samples from a copy of its leader's logits.
        emitting = [p for p in live if not p.seq.uncached_prompt] + siblings
        index = [row_of[id(p)] if p.item is not None else row_of[id(p.leader)] for p in emitting]
        slots = np.array([p.seq.slot for p in emitting], dtype=np.int64)
        # Usually every row of the step, in order: then the forward pass's own array (a fresh one
        # each step), not a copy of a vocabulary a row (12.5 MB at 64 rows: a GPU step's third).
        emitted = logits if index == list(range(len(logits))) else logits[index]
        self._constrain(emitting, emitted)  # a sibling's constraint too, on its copy of the leader's row
        tokens: np.ndarray | list[int] = self._sampler.sample(emitted, slots) if emitting else []
        for p, token, lp in zip(emitting, tokens, self._sampler.last_logprobs if emitting else []):
            results[p.row_index] = self._emit(p.seq, int(token), self._token_logprob(int(token), lp))
        for p in live:
            if p.seq.uncached_prompt:
                results[p.row_index] = _prefilling(p.seq)

    def interrupt(self, keep: bool = False) -> bool:
        """Stops the interruptible step in progress (called from another thread); whether one was.
        With `keep`, when none was computing, the next step stops before it computes if it is
        interruptible and starts soon (ForwardModel.interrupt)."""
        return self._model.interrupt(keep)

    def _defer_over_prefill_budget(self, pending: list[_Pending], results: list[RowResult | None]) -> None:
        """Prompts beyond the step's prefill budget wait for a later step (whole: a prompt is not cut
        to fill the budget). On a compute-bound engine a prompt costs about its tokens wherever it
        goes, so computing every waiting prompt in one step only holds every first token back until
        the last prompt is in; within a budget the first prompts answer a step earlier each, as one
        after another would. The step's first prompt always goes, however long; a leader whose
        siblings copy its cells this step goes too. A deferred sequence keeps its slot and answers
        no token (finish ""), and its next decode row computes its prompt (the next step of a round
        too)."""
        budget = self.prefill_tokens_per_step
        if not budget:
            return
        leaders = {id(p.leader) for p in pending if p.leader is not None}
        spent = 0
        for p in pending:
            if p.cancelled or p.item is None or not p.prompt:
                continue
            tokens = len(p.item.token_ids)
            if spent and spent + tokens > budget and id(p) not in leaders:
                p.deferred = True
                p.seq.uncached_prompt = list(p.item.token_ids) + p.seq.uncached_prompt
                results[p.row_index] = _prefilling(p.seq)
                self.prefills_deferred_total += 1
            else:
                spent += tokens

    def _token_logprob(self, token: int, found: RowLogprobs | None) -> TokenLogprob | None:
        if found is None:
            return None
        top = tuple(TopLogprob(*self._piece(t), logprob, token_id=t) for t, logprob in found.top)
        return TokenLogprob(*self._piece(token), found.logprob, top, token_id=token, rank=found.rank)

    def _piece(self, token: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_piece(token)
        return raw.decode("utf-8", errors="replace"), raw

    # -- row handling -------------------------------------------------------

    def _admit_or_fail(self, index: int, row: PrefillRow) -> _Pending | RowResult:
        """_admit; a fault in it (restoring a slot's state, starting the sampler) fails this row alone,
        without the sequence it half made or the slot it took."""
        running = row.seq_id in self._seqs
        try:
            return self._admit(index, row)
        except Exception as exc:
            if not running and (seq := self._seqs.get(row.seq_id)) is not None:
                self._free(seq, keep_cells=False)
            self._recover_slots()
            request = f" (request {row.request_id})" if row.request_id else ""
            log.warning("admission_failed: seq %d%s: %r", row.seq_id, request, exc)
            return _error(row.seq_id, f"admission failed: {exc!r}")

    def _recover_slots(self) -> None:
        """Slots neither free nor held by a sequence (taken by an admission that failed): cleared and freed."""
        held = {seq.slot for seq in self._seqs.values()}
        for slot in range(self.max_slots):
            if slot not in held and not self._slots.is_free(slot):
                self._model.release(slot)
                self._slots.free(slot, None)

    def _fail(self, rows: list[_Pending], message: str, results: list[RowResult | None]) -> None:
        """Fails a step's rows: their sequences end, their cells forgotten (they may be half written).
        Logged with the sequences it ends (seq_id and request id, bounded): the caller's lines name them."""
        named = [f"seq {p.seq.seq_id}{_request_of(p.seq)}" for p in rows[:MAX_LOGGED_SEQUENCES]]
        more = f" and {len(rows) - MAX_LOGGED_SEQUENCES} more" if len(rows) > MAX_LOGGED_SEQUENCES else ""
        log.warning("step_rows_failed: %s; sequences: %s%s", message, ", ".join(named), more)
        for p in rows:
            self._free(p.seq, keep_cells=False)
            results[p.row_index] = _error(p.seq.seq_id, message, p.seq)

    def _admit(self, index: int, row: PrefillRow) -> _Pending | RowResult:
        found = problem(row.params, self.vocab_size)
        if found is not None:
            return _invalid(row.seq_id, field_error(*found))
        if row.seq_id in self._seqs:
            return _error(row.seq_id, f"seq_id {row.seq_id} is already running")
        matcher = None
        # What the output must match (constraints.py): each token is sampled from those that keep it
        # matching, and the sequence finishes "stop" once it is complete. Compiled at admission: one the
        # library cannot compile against this vocabulary (a token it lacks, which no front without the
        # vocabulary can see) is the client's error: finish "invalid" before any token.
        if row.params.structured_outputs is not None:
            try:
                matcher = self.compile_constraint(row.params.structured_outputs).matcher()
            except StructuredOutputsError as exc:
                return _invalid(row.seq_id, field_error("structured_outputs", str(exc)))
        ids = self.tokenizer.encode(row.prompt) if isinstance(row.prompt, str) else list(row.prompt)
        n = len(ids)
        if n == 0:
            return _invalid(row.seq_id, "prompt is empty (0 tokens)")  # the caller's error, not the engine's
        if n + row.params.max_tokens > self._ctx:
            return _error(
                row.seq_id,
                f"prompt is {n} tokens and max_tokens is {row.params.max_tokens}; the context holds "
                f"{self._ctx} tokens including max_tokens: shorten the prompt or lower max_tokens",
                prompt_tokens=n,
            )
        if not self._slot_free_for(row.owner):
            if row.owner:
                self._refused[row.owner] = self._clock()
            if not self._slots and self._all_held_unstepped():
                return RowResult(
                    row.seq_id,
                    -1,
                    "",
                    "stale",
                    n,
                    0,
                    f"every slot (max_slots={self.max_slots}) is held by sequences nobody has stepped for"
                    f" {LEASE_MIN_STEPS} steps (their adapter stopped or dropped them) until the slot lease frees them",
                )
            return RowResult(row.seq_id, -1, "", "busy", n, 0, f"no free slot (max_slots={self.max_slots}); retry the prefill later")
        self._refused.pop(row.owner, None)
        if row.chunk < 0:
            return _error(row.seq_id, f"chunk must be >= 0 (got {row.chunk})")
        whole = row.chunk == 0 or row.chunk >= n
        leader = self._leaders.get(tuple(ids)) if whole and self._slots.enabled else None
        if leader is not None and not leader.cancelled:
            return self._sibling(index, row, ids, leader, matcher)
        slot, reused, cells = self._place(ids)
        self.prefills_total += 1
        if reused:
            self.prefix_hits_total += 1
            self.cached_tokens_total += reused
        seq = self._start_seq(row, slot, ids, matcher, pos=reused, uncached_prompt=ids[reused:], cells=cells, cached_tokens=reused)
        pending = _Pending(index, seq, BatchItem(seq.slot, _next_chunk(seq), reused))
        if whole and not seq.uncached_prompt:
            self._leaders.setdefault(tuple(ids), pending)
        return pending

    def _sibling(self, index: int, row: PrefillRow, ids: list[int], leader: _Pending, matcher: Matcher | None) -> _Pending:
        """A prefill of the same prompt as `leader`'s in this step: a slot of its own, filled from
        the leader's after the forward pass (step)."""
        slot, n = self._take_free_slot(), len(ids)
        self.prefills_total += 1
        self.prefix_hits_total += 1
        self.cached_tokens_total += n
        seq = self._start_seq(row, slot, ids, matcher, cached_tokens=n)
        return _Pending(index, seq, None, leader=leader)

    def _start_seq(self, row: PrefillRow, slot: int, ids: list[int], matcher: Matcher | None, **placement: Any) -> _Seq:
        """A new sequence in `slot` for the row's prompt `ids`, registered and its sampler state
        started; `placement` says what of the prompt its slot already holds (_Seq's fields)."""
        seq = _Seq(
            seq_id=row.seq_id,
            slot=slot,
            params=row.params,
            prompt_tokens=len(ids),
            detok=self.tokenizer.detokenizer(),
            stopper=StopFilter(row.params.stop),
            chunk=row.chunk,
            owner=row.owner,
            request_id=row.request_id,
            matcher=matcher,
            last_stepped_at=self._clock(),
            last_stepped_step=self._steps,
            **placement,
        )
        self._seqs[row.seq_id] = seq
        self._sampler.start(slot, row.params, ids)
        return seq

    def _place(self, prompt: list[int]) -> tuple[int, int, Cells]:
        """A slot for a new sequence, how many of its prompt's tokens that slot already holds, and
        their cells. At least the last prompt token is always prefilled: its logits sample the first
        token; and on the CPU, only as many tokens are reused as leave the logits bit for bit those
        of the prompt's cold prefill whole (prefix_cache.exact_reuse; a prompt prefilled in chunks of
        fewer than 64 tokens computes its rows with another kernel, and has no such guarantee)."""
        limit = len(prompt) - 1
        cached_slot, from_cache = self._slots.longest(prompt, limit) if self._slots.enabled else (None, 0)
        if cached_slot is not None:
            from_cache = self._exact(from_cache, self._slots.cells(cached_slot), prompt)
        live, from_live = self._longest_live(prompt, limit)
        if live is not None:
            from_live = self._exact(from_live, live.cells, prompt)
        stored, from_host = self._host.longest(prompt, limit) if self._host.enabled else (None, 0)
        if stored is not None:
            from_host = self._exact(from_host, self._host.cells(stored), prompt)
        if max(from_cache, from_live, from_host) < MIN_REUSED_TOKENS:
            return self._take_free_slot(), 0, Cells()
        if from_host > max(from_cache, from_live):
            return self._restore(stored, from_host)  # type: ignore[arg-type]
        if cached_slot is not None and from_cache >= from_live and self._reuse_in_place(cached_slot, from_cache):
            cells = self._slots.take(cached_slot)
            self._model.truncate(cached_slot, from_cache)
            return cached_slot, from_cache, cells.prefix(from_cache)
        if from_cache >= from_live:
            source, reused, cells = cached_slot, from_cache, self._slots.used(cached_slot)  # type: ignore[arg-type]
        else:
            source, reused, cells = live.slot, from_live, live.cells  # type: ignore[union-attr]
        slot = self._take_free_slot()
        self._model.copy(source, slot)  # type: ignore[arg-type]
        self._model.truncate(slot, reused)
        return slot, reused, cells.prefix(reused)

    def _restore(self, stored: int, reused: int) -> tuple[int, int, Cells]:
        """A free slot holding a prefix from the host store (taken out of it first, so that the
        slot's own eviction cannot drop it)."""
        cells, state = self._host.take(stored)
        slot = self._take_free_slot()
        self._model.restore_state(slot, state)  # type: ignore[attr-defined]
        self._model.truncate(slot, reused)
        self.host_restores_total += 1
        return slot, reused, cells.prefix(reused)

    def _exact(self, shared: int, cells: Cells, prompt: list[int]) -> int:
        return exact_reuse(shared, cells, len(prompt), self._model.tiled_attention_rows)

    def _reuse_in_place(self, slot: int, reused: int) -> bool:
        """Continue in the cached slot itself, unless it holds much more than this prompt shares
        and an empty slot can take a copy instead (the rest stays cached for a later prompt)."""
        return not self._slots.has_empty or 2 * reused >= len(self._slots.cells(slot).tokens)

    def _longest_live(self, prompt: list[int], limit: int) -> tuple[_Seq | None, int]:
        if not self._slots.enabled:
            return None, 0
        best, shared = None, 0
        for seq in self._seqs.values():
            n = min(common_prefix(seq.cells.tokens, prompt), limit)
            if n > shared:
                best, shared = seq, n
        return best, shared

    def _take_free_slot(self) -> int:
        slot, evicted = self._slots.take_any()
        if evicted is not None:
            if self._host.enabled:
                self._host.put(evicted, self._model.save_state(slot))  # type: ignore[attr-defined]
            self._model.release(slot)
        return slot

    def _queue_decode(self, index: int, seq_id: int, pending: list[_Pending]) -> _Pending | RowResult:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return _error(seq_id, f"seq_id {seq_id} is not running (never started, finished or released)")
        if any(p.seq is seq and not p.cancelled for p in pending):
            return _error(seq_id, f"seq_id {seq_id} already advances in this step", seq)
        tokens = _next_chunk(seq) if seq.uncached_prompt else [seq.last_token]
        return _Pending(index, seq, BatchItem(seq.slot, tokens, seq.pos))

    def _release(self, seq_id: int, pending: list[_Pending]) -> RowResult:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return RowResult(seq_id, -1, "", "", 0, 0)
        for p in pending:
            if p.seq is seq:
                p.cancelled = True
        self._free(seq)
        return RowResult(seq_id, -1, "", "", seq.prompt_tokens, seq.completion_tokens, cached_tokens=seq.cached_tokens)

    def _slot_free_for(self, owner: str) -> bool:
        """A free slot this owner may take: owners turned away earlier come first."""
        now = self._clock()
        self._refused = {o: at for o, at in self._refused.items() if now - at <= REFUSED_MEMORY_S}
        ahead = 0
        for waiting in self._refused:
            if waiting == owner:
                break
            ahead += 1
        return len(self._slots) > ahead

    def _all_held_unstepped(self) -> bool:
        return all(self._steps - s.last_stepped_step > LEASE_MIN_STEPS for s in self._seqs.values())

    def _reclaim_expired(self, now: float) -> None:
        """Releases sequences nobody stepped within the lease: their scheduler is gone."""
        if self._slot_lease_s <= 0:
            return
        expired = [
            s for s in self._seqs.values() if now - s.last_stepped_at > self._slot_lease_s and self._steps - s.last_stepped_step > LEASE_MIN_STEPS
        ]
        for seq in expired:
            self._free(seq)
            self.slots_reclaimed_total += 1
            # Who left it: an operator (or a test) traces the leak back to the adapter that held it.
            self.reclaimed_recently.append(
                f"seq {seq.seq_id}{_request_of(seq)} of {seq.owner or '?'}: idle {now - seq.last_stepped_at:.1f} s, "
                f"{seq.prompt_tokens} prompt and {seq.completion_tokens} completion tokens"
            )

    def _free(self, seq: _Seq, keep_cells: bool = True) -> None:
        """Frees a sequence's slot; its KV cells stay for the prefix cache unless they are not to be trusted."""
        if self._seqs.pop(seq.seq_id, None) is not None:
            kept = seq.cells if keep_cells and self._slots.worth_keeping(seq.cells) else None
            if kept is None:
                self._model.release(seq.slot)
            self._slots.free(seq.slot, kept)

    def _constrain(self, emitting: list[_Pending], logits: np.ndarray) -> None:
        """Masks the logits (one row per emitting row) of the rows under a constraint, all in one
        pass, so that only tokens their constraints allow can be sampled; other rows are untouched."""
        rows = [i for i, p in enumerate(emitting) if p.seq.matcher is not None]
        if not rows:
            return
        started = time.perf_counter()
        matchers = [emitting[i].seq.matcher for i in rows]
        apply_masks(logits, rows, compute_masks(matchers, self.tokenizer.vocab_size))  # type: ignore[arg-type]
        self.constraint_mask_seconds_total += time.perf_counter() - started
        self.constraint_masks_total += len(rows)

    def _emit(self, seq: _Seq, tok: int, logprob: TokenLogprob | None = None) -> RowResult:
        """The sequence's sampled token: its text, and whether it ends the sequence."""
        self.tokens_generated_total += 1
        seq.completion_tokens += 1
        seq.last_token = tok
        if seq.matcher is not None and tok not in self.tokenizer.stop_ids and not seq.matcher.consume(tok):
            # Cannot happen with the mask applied; a library fault must not pass as valid output.
            self._free(seq)
            return _error(seq.seq_id, f"constraint refused token {tok}: {seq.matcher.error}", seq)

        finish = ""
        if tok in self.tokenizer.stop_ids:
            # EOS text is never shown, nor its logprob (OpenAI's content lists the tokens of the
            # text only); release held-back bytes/text as-is.
            logprob = None
            text = seq.stopper.feed(seq.detok.flush())[0] + seq.stopper.flush()
            finish = "stop"
        else:
            text, hit = seq.stopper.feed(seq.detok.push(tok))
            if hit:
                finish = "stop"
            elif ended := self._ended(seq):
                tail, hit = seq.stopper.feed(seq.detok.flush())
                text += tail if hit else tail + seq.stopper.flush()
                finish = "stop" if hit else ended
        if finish:
            self._free(seq)
        return RowResult(seq.seq_id, tok, text, finish, seq.prompt_tokens, seq.completion_tokens, cached_tokens=seq.cached_tokens, logprobs=logprob)

    def _ended(self, seq: _Seq) -> str:
        """Why a sequence that sampled an ordinary token ends now, or "" if it goes on."""
        if seq.matcher is not None and seq.matcher.complete:
            return "stop"  # its constraint allows nothing but the end: end now rather than sample it
        if seq.completion_tokens >= seq.params.max_tokens or seq.pos >= self._ctx:
            return "length"  # pos >= ctx: no cache position left to feed this token back
        return ""


class ForwardModel(Protocol):
    """What the engine needs of a model: logits for a ragged batch, and slots to forget, copy and cut."""

    def forward(self, items: list[BatchItem], interruptible: bool = False) -> np.ndarray:
        """`interruptible`: `interrupt()` may stop it midway (StepInterrupted), every item's cells
        left as they were."""

    def interrupt(self, keep: bool = False) -> bool:
        """Stops the interruptible forward pass in progress; whether one was stopped. With `keep`,
        when none was in progress, the next one does not start if it is interruptible and starts
        soon (StepInterrupted); a forward pass that is not interruptible forgets the ask."""

    def release(self, slot: int) -> None: ...

    def copy(self, source: int, target: int) -> None:
        """The target slot's cells become a copy of the source's (before the next forward pass)."""

    def truncate(self, slot: int, keep: int) -> None:
        """Forgets the slot's cells from position `keep` on."""

    # Query rows of one sequence in one step from which attention runs a kernel of its own (whose
    # results differ in the last bits from the row-by-row kernel's); None: no such kernel, or none
    # the prefix cache can keep its reuse exact with. A model with such a kernel says, after each
    # forward pass, which of each item's new tokens ran it: `last_tiled` (list[list[bool]]).
    tiled_attention_rows: int | None
    # Whether a prompt that reuses cached cells gets, bit for bit, the logits of its cold prefill
    # (whole, alone in its step): llama.cpp on the CPU, where exact_reuse keeps it so; not the numpy model
    # (its matrix products round by the step's token count) nor llama.cpp on a GPU.
    reuse_bit_exact: bool


def _forward_model(
    engine: str,
    reader: gguf.GGUFReader,
    gguf_path: str,
    max_slots: int,
    ctx: int,
    threads: int,
    gpu_layers: int,
    main_gpu: int | None,
    low_memory: bool,
    adaptive_threads: bool = False,
) -> ForwardModel:
    if engine == "llamacpp":
        from .llamacpp_model import LlamaCppModel  # imports llama.cpp's shared library

        return LlamaCppModel(gguf_path, max_slots, ctx, threads=threads, gpu_layers=gpu_layers, main_gpu=main_gpu, adaptive_threads=adaptive_threads)
    if engine == "numpy":
        return LlamaModel(load_weights(reader, dual_layout=not low_memory), max_slots, ctx)
    raise ValueError(f"engine must be 'llamacpp' or 'numpy' (got {engine!r})")


def _next_chunk(seq: _Seq) -> list[int]:
    """Takes the prompt tokens this step caches off the sequence's uncached prompt."""
    size = seq.chunk or len(seq.uncached_prompt)
    tokens, seq.uncached_prompt = seq.uncached_prompt[:size], seq.uncached_prompt[size:]
    return tokens


def _untouched(pending: _Pending) -> RowResult:
    """A row of an interrupted step: no token, and the sequence as before the step (the prompt
    tokens it was to cache go back in front of its uncached prompt)."""
    seq = pending.seq
    if pending.prompt and pending.item is not None:
        seq.uncached_prompt = list(pending.item.token_ids) + seq.uncached_prompt
    return RowResult(seq.seq_id, -1, "", "", seq.prompt_tokens, seq.completion_tokens, cached_tokens=seq.cached_tokens)


def _prefilling(seq: _Seq) -> RowResult:
    """A step that cached part of the prompt: no token yet."""
    return RowResult(seq.seq_id, -1, "", "", seq.prompt_tokens, 0, cached_tokens=seq.cached_tokens)


def _invalid(seq_id: int, message: str) -> RowResult:
    """A row refused for what its request asked (the caller's error, step_protocol's "invalid")."""
    return RowResult(seq_id=seq_id, token_id=-1, text="", finish_reason="invalid", prompt_tokens=0, completion_tokens=0, error=message)


def _request_of(seq: _Seq) -> str:
    """ " (request <id>)" for a log line, when its caller named one."""
    return f" (request {seq.request_id})" if seq.request_id else ""


def _error(seq_id: int, message: str, seq: _Seq | None = None, prompt_tokens: int = 0) -> RowResult:
    return RowResult(
        seq_id=seq_id,
        token_id=-1,
        text="",
        finish_reason="error",
        prompt_tokens=seq.prompt_tokens if seq else prompt_tokens,
        completion_tokens=seq.completion_tokens if seq else 0,
        error=message,
        cached_tokens=seq.cached_tokens if seq else 0,
    )
