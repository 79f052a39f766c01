"""`sluice eval`'s plain logic: the dataset, the two sides' settings, and the comparison of their
scores into a side-by-side table and a verdict. No gRPC here (eval_run.py does the calls).

The gate compares PASS RATES, B minus A, per evaluator: every evaluator has a pass/fail verdict,
and a pass rate is a share in [0, 1] whichever way the evaluator's value points and whatever its
unit (milliseconds, a cosine, a count), so one absolute threshold (0.05: five points) means the
same on every line. Mean values are shown beside it for reading. Rows that failed (a row error
from the job) are not scored but counted: the first line of the table, `rows_ok`, is the share of
rows that produced an output, gated like an evaluator, so a B that fails rows cannot pass the gate
by having fewer rows scored. An evaluator that scored rows on one side only fails the gate too:
nothing shows that B holds there.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

from sluice_common.jsonl import jsonl_lines
from sluice_common.sampling import Sampling

# Exit codes of `sluice eval` (docs/operators/ab-evaluation.md): 0 no regression, 1 B regressed beyond the threshold on
# some line, 2 the comparison could not be made (bad input or settings, an RPC failed, a job did not complete, the
# --output file could not be written), 130 interrupted (Ctrl-C: its jobs cancelled).
EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130

ROWS_OK = "rows_ok"
# Pass rates are shares of counts, so their difference carries float rounding: 17/20 - 18/20 is
# -0.05000000000000004. A delta within this of the threshold is the threshold (not a regression).
DELTA_TOLERANCE = 1e-9
# The verdict of a line scored on one side only; it fails the gate.
ONE_SIDE_ONLY = "one side only"

# The options `--sampling-a/-b` may set: every field of the sampling contract, with its type (stop
# repeats; logit_bias is written id:bias and repeats).
# Options a --sampling string can set: every Sampling field but the structured-output constraint
# (a schema does not fit name=value); the optional integers by name, as their default is None.
SAMPLING_FIELDS: dict[str, type] = {
    f.name: int if f.name in ("seed", "logprobs") else str if isinstance(f.default, tuple) else type(f.default)
    for f in fields(Sampling)
    if f.name != "structured_outputs"
}


class DatasetError(ValueError):
    """A dataset line that is not a usable row; the message names the line."""


@dataclass(frozen=True)
class DatasetRow:
    custom_id: str
    # Either a prompt (sent as one user message) or whole chat messages as (role, content).
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    reference: str = ""

    def chat(self) -> tuple[tuple[str, str], ...]:
        return self.messages or (("user", self.prompt),)


def _row(number: int, data: object, source: str) -> DatasetRow:
    where = f"{source}:{number}"
    if not isinstance(data, dict):
        raise DatasetError(f"{where}: a row must be a JSON object with a prompt (or messages) and optionally a reference")
    unknown = set(data) - {"id", "custom_id", "prompt", "messages", "reference"}
    if unknown:
        raise DatasetError(f"{where}: unknown field(s) {sorted(unknown)}; a row has id, prompt or messages, reference")
    custom_id = str(data.get("custom_id") or data.get("id") or f"row-{number}")
    prompt, messages, reference = data.get("prompt", ""), data.get("messages", []), data.get("reference", "")
    if not isinstance(prompt, str) or not isinstance(reference, str):
        raise DatasetError(f"{where}: prompt and reference must be strings")
    if bool(prompt) == bool(messages):
        raise DatasetError(f"{where}: give exactly one of prompt or messages")
    if messages:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
        ):
            raise DatasetError(f'{where}: messages must be a list of {{"role": ..., "content": ...}}')
    return DatasetRow(custom_id, prompt, tuple((m["role"], m["content"]) for m in messages), reference)


def parse_dataset(text: str, source: str = "dataset") -> list[DatasetRow]:
    """JSON lines: {"id"?, "prompt" | "messages", "reference"?}; blank lines skipped; ids unique."""
    rows: list[DatasetRow] = []
    for number, line in enumerate(jsonl_lines(text), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{source}:{number}: not JSON: {exc}") from None
        rows.append(_row(number, data, source))
    if not rows:
        raise DatasetError(f"{source}: no rows")
    seen: set[str] = set()
    for row in rows:
        if row.custom_id in seen:
            raise DatasetError(f"{source}: the id {row.custom_id!r} appears twice")
        seen.add(row.custom_id)
    return rows


def parse_sampling(text: str) -> dict[str, object]:
    """`temperature=1.0,seed=7,max_tokens=8` -> {"temperature": 1.0, ...}; stop may repeat."""
    settings: dict[str, object] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in SAMPLING_FIELDS:
            raise ValueError(f"{part!r}: expected name=value with name one of {', '.join(SAMPLING_FIELDS)}")
        if name == "logit_bias":
            token, colon, bias = value.partition(":")
            try:
                settings.setdefault("logit_bias", {})[str(int(token))] = float(bias)  # type: ignore[index]
            except ValueError:
                raise ValueError(f"{part!r}: logit_bias must be token_id:bias, such as logit_bias=28:-100") from None
            continue
        try:
            parsed = SAMPLING_FIELDS[name](value.strip())
        except ValueError:
            raise ValueError(f"{part!r}: {name} must be a {SAMPLING_FIELDS[name].__name__}") from None
        if name == "stop":
            stops = settings.setdefault("stop", [])
            assert isinstance(stops, list)
            stops.append(parsed)
        else:
            settings[name] = parsed
    return settings


@dataclass(frozen=True)
class Side:
    """One side of the comparison: a model and its sampling settings."""

    label: str
    model: str
    sampling: dict[str, object] = field(default_factory=dict)

    def describe(self) -> str:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(self.sampling.items()))
        return f"{self.model} ({settings})" if settings else self.model


@dataclass(frozen=True)
class RowScore:
    name: str
    value: float
    passed: bool
    skipped: bool = False


@dataclass(frozen=True)
class SideStats:
    n: int = 0
    mean: float = 0.0
    pass_rate: float = 0.0
    skipped: int = 0


def side_stats(rows: Iterable[Sequence[RowScore]]) -> dict[str, SideStats]:
    """Per evaluator over one side's scored rows; skipped scores are counted apart, not averaged."""
    totals: dict[str, list[float]] = {}
    passes: dict[str, int] = {}
    skips: dict[str, int] = {}
    for scores in rows:
        for score in scores:
            if score.skipped:
                skips[score.name] = skips.get(score.name, 0) + 1
                continue
            totals.setdefault(score.name, []).append(score.value)
            passes[score.name] = passes.get(score.name, 0) + (1 if score.passed else 0)
    names = set(totals) | set(skips)
    return {
        name: SideStats(
            n=len(totals.get(name, [])),
            mean=sum(totals.get(name, [])) / len(totals[name]) if totals.get(name) else 0.0,
            pass_rate=passes.get(name, 0) / len(totals[name]) if totals.get(name) else 0.0,
            skipped=skips.get(name, 0),
        )
        for name in names
    }


def rows_ok_stats(total: int, failed: int) -> SideStats:
    ok = total - failed
    return SideStats(n=total, mean=ok / total if total else 0.0, pass_rate=ok / total if total else 0.0)


@dataclass(frozen=True)
class Line:
    evaluator: str
    higher_is_better: bool
    a: SideStats
    b: SideStats

    @property
    def comparable(self) -> bool:
        return self.a.n > 0 and self.b.n > 0

    @property
    def delta(self) -> float:
        """B's pass rate minus A's: negative is worse."""
        return self.b.pass_rate - self.a.pass_rate if self.comparable else 0.0

    def verdict(self, threshold: float) -> str:
        if not self.comparable:
            return "n/a" if not (self.a.n or self.b.n) else ONE_SIDE_ONLY
        if self.delta < -threshold - DELTA_TOLERANCE:
            return "REGRESSED"
        if self.delta > threshold + DELTA_TOLERANCE:
            return "improved"
        return "same"


@dataclass(frozen=True)
class Report:
    lines: list[Line]
    threshold: float

    @property
    def regressions(self) -> list[str]:
        return [line.evaluator for line in self.lines if line.verdict(self.threshold) == "REGRESSED"]

    @property
    def one_sided(self) -> list[str]:
        """Evaluators that scored rows on one side only: the gate cannot vouch for B there (an
        evaluator that stopped scoring B, or scores B alone), so they fail it as a regression does."""
        return [line.evaluator for line in self.lines if line.verdict(self.threshold) == ONE_SIDE_ONLY]

    @property
    def exit_code(self) -> int:
        return EXIT_REGRESSION if self.regressions or self.one_sided else EXIT_OK


def compare(
    evaluators: Sequence[tuple[str, bool]],
    a_rows: Sequence[Sequence[RowScore]],
    b_rows: Sequence[Sequence[RowScore]],
    a_total_failed: tuple[int, int],
    b_total_failed: tuple[int, int],
    threshold: float,
) -> Report:
    """One line per evaluator (name, higher_is_better) in the order given, after `rows_ok`; an
    evaluator that scored nothing on either side still gets its line (n/a), so a missing evaluator
    is visible rather than absent. Evaluators not in `evaluators` but found in the scores are added."""
    a_stats, b_stats = side_stats(a_rows), side_stats(b_rows)
    known = dict(evaluators)
    for name in sorted((set(a_stats) | set(b_stats)) - set(known)):
        known[name] = True
    lines = [Line(ROWS_OK, True, rows_ok_stats(*a_total_failed), rows_ok_stats(*b_total_failed))]
    lines += [Line(name, better, a_stats.get(name, SideStats()), b_stats.get(name, SideStats())) for name, better in known.items()]
    return Report(lines, threshold)


def _n(stats: SideStats) -> str:
    return f"{stats.n}" + (f"+{stats.skipped}s" if stats.skipped else "")


def render(report: Report, a: Side, b: Side) -> str:
    """The side-by-side table and the verdict line."""
    head = f"{'EVALUATOR':<22} {'BETTER':<6} {'MEAN A':>10} {'MEAN B':>10} {'PASS A':>7} {'PASS B':>7} {'DELTA':>7} {'N A':>6} {'N B':>6}  VERDICT"
    out = [f"A: {a.describe()}", f"B: {b.describe()}", "", head]
    for line in report.lines:
        both = line.comparable
        out.append(
            f"{line.evaluator:<22} {'higher' if line.higher_is_better else 'lower':<6}"
            f" {_mean(line.a):>10} {_mean(line.b):>10}"
            f" {_share(line.a):>7} {_share(line.b):>7} {(f'{line.delta * 100:+.1f}%' if both else '-'):>7}"
            f" {_n(line.a):>6} {_n(line.b):>6}  {line.verdict(report.threshold)}"
        )
    out.append("")
    out.append("DELTA is B's pass rate minus A's; N counts scored rows (+Ns: skipped, e.g. embeddings unavailable).")
    failures = []
    if report.regressions:
        failures.append(f"B's pass rate is more than {report.threshold * 100:.1f} points below A's on: {', '.join(report.regressions)}")
    if report.one_sided:
        failures.append(f"scored on one side only, so not compared: {', '.join(report.one_sided)}")
    if failures:
        out.append(f"VERDICT: {'REGRESSION' if report.regressions else 'FAILED'}: {'; '.join(failures)}")
    else:
        out.append(f"VERDICT: OK: B is within {report.threshold * 100:.1f} points of A on every evaluator")
    return "\n".join(out)


def _mean(stats: SideStats) -> str:
    return f"{stats.mean:.3f}" if stats.n else "-"


def _share(stats: SideStats) -> str:
    return f"{stats.pass_rate * 100:.1f}%" if stats.n else "-"
