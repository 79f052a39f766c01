"""`sluice eval`'s plain logic: dataset, sampling settings, the comparison and its verdict."""

from __future__ import annotations

import pytest

from sluice_cli.eval_compare import (
    EXIT_OK,
    EXIT_REGRESSION,
    DatasetError,
    RowScore,
    Side,
    compare,
    parse_dataset,
    parse_sampling,
    render,
    side_stats,
)

EVALUATORS = [("truncation", False), ("exact_match", True), ("reference_similarity", True), ("json_validity", True)]


def rows(*specs: tuple[str, float, bool]) -> list[list[RowScore]]:
    """One row per spec; each spec (name, value, passed)."""
    return [[RowScore(name, value, passed)] for name, value, passed in specs]


def test_dataset_rows_prompt_or_messages_with_optional_reference() -> None:
    text = (
        '{"id": "q1", "prompt": "Capital of France?", "reference": "Paris"}\n\n'
        '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}\n'
    )
    first, second = parse_dataset(text, "d.jsonl")
    assert (first.custom_id, first.chat(), first.reference) == ("q1", (("user", "Capital of France?"),), "Paris")
    assert second.custom_id == "row-3" and second.chat()[0] == ("system", "Be brief.") and second.reference == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no rows"),
        ("not json", "d.jsonl:1: not JSON"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one of prompt or messages"),
        ('{"reference": "x"}', "exactly one of prompt or messages"),
        ('{"prompt": "a", "answer": "b"}', "unknown field"),
        ('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}', "appears twice"),
        ('{"messages": [{"role": "user"}]}', "messages must be a list"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_datasets_name_the_line(text: str, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        parse_dataset(text, "d.jsonl")


def test_sampling_settings() -> None:
    assert parse_sampling("temperature=1.0, seed=7,max_tokens=1,stop=END,stop=###") == {
        "temperature": 1.0, "seed": 7, "max_tokens": 1, "stop": ["END", "###"],
    }  # fmt: skip
    assert parse_sampling("") == {}
    with pytest.raises(ValueError, match="one of"):
        parse_sampling("temp=1")
    with pytest.raises(ValueError, match="must be a int"):
        parse_sampling("max_tokens=many")


def test_side_stats_keep_skipped_scores_out_of_the_mean() -> None:
    stats = side_stats([[RowScore("s", 0.8, True)], [RowScore("s", 0.2, False)], [RowScore("s", 0.0, False, skipped=True)]])
    assert stats["s"].n == 2 and stats["s"].skipped == 1
    assert stats["s"].mean == pytest.approx(0.5) and stats["s"].pass_rate == pytest.approx(0.5)


def test_b_within_the_threshold_passes_and_beyond_it_regresses() -> None:
    a = rows(*[("exact_match", 1.0, True)] * 19, ("exact_match", 0.0, False))  # 95%
    b_close = rows(*[("exact_match", 1.0, True)] * 18, *[("exact_match", 0.0, False)] * 2)  # 90%: -5 points
    b_worse = rows(*[("exact_match", 1.0, True)] * 17, *[("exact_match", 0.0, False)] * 3)  # 85%: -10 points
    ok = compare(EVALUATORS, a, b_close, (20, 0), (20, 0), threshold=0.05)
    assert ok.exit_code == EXIT_OK and ok.regressions == []
    bad = compare(EVALUATORS, a, b_worse, (20, 0), (20, 0), threshold=0.05)
    assert bad.exit_code == EXIT_REGRESSION and bad.regressions == ["exact_match"]
    line = next(line for line in bad.lines if line.evaluator == "exact_match")
    assert line.delta == pytest.approx(-0.10) and line.verdict(0.05) == "REGRESSED"


@pytest.mark.parametrize(("a_passed", "b_passed"), [(18, 17), (19, 18)])
def test_a_drop_of_exactly_the_threshold_is_not_a_regression(a_passed: int, b_passed: int) -> None:
    """17/20 - 18/20 is -0.05000000000000004 in floats, 18/20 - 19/20 is -0.04999999999999993: the same
    five-point drop was REGRESSED or not by rounding; --threshold is the largest drop that is not."""

    def side(passed: int) -> list[list[RowScore]]:
        return rows(*[("exact_match", 1.0, True)] * passed, *[("exact_match", 0.0, False)] * (20 - passed))

    report = compare(EVALUATORS, side(a_passed), side(b_passed), (20, 0), (20, 0), threshold=0.05)
    assert report.exit_code == EXIT_OK and report.regressions == []
    assert compare(EVALUATORS, side(b_passed), side(a_passed), (20, 0), (20, 0), threshold=0.05).lines[2].verdict(0.05) == "same"
    beyond = compare(EVALUATORS, side(a_passed), side(b_passed - 1), (20, 0), (20, 0), threshold=0.05)
    assert beyond.regressions == ["exact_match"]


def test_dataset_lines_split_at_newlines_only() -> None:
    """str.splitlines also split at U+2028, U+0085 and other breaks a JSON string may hold unescaped."""
    text = '{"id": "a", "prompt": "one\u2028two\u0085three"}\r\n{"id": "b", "prompt": "x"}\r\n'
    first, second = parse_dataset(text, "d.jsonl")
    assert first.prompt == "one\u2028two\u0085three" and second.custom_id == "b"


def test_lower_is_better_evaluators_are_gated_on_their_pass_rate_too() -> None:
    # truncation's value is 1 for a truncated answer (lower is better); its pass rate still is higher-is-better.
    a = rows(("truncation", 0.0, True), ("truncation", 0.0, True))
    b = rows(("truncation", 1.0, False), ("truncation", 1.0, False))
    report = compare(EVALUATORS, a, b, (2, 0), (2, 0), threshold=0.05)
    assert report.regressions == ["truncation"]
    assert compare(EVALUATORS, b, a, (2, 0), (2, 0), threshold=0.05).exit_code == EXIT_OK  # B better: improved


def test_failed_rows_count_against_their_side() -> None:
    a = rows(("exact_match", 1.0, True), ("exact_match", 1.0, True))
    b = rows(("exact_match", 1.0, True))  # the other row failed: its pass rate alone looks perfect
    report = compare(EVALUATORS, a, b, (2, 0), (2, 1), threshold=0.05)
    assert report.regressions == ["rows_ok"]
    assert report.lines[0].a.pass_rate == 1.0 and report.lines[0].b.pass_rate == 0.5


def test_every_evaluator_gets_a_line_even_when_nothing_applied() -> None:
    report = compare(EVALUATORS, rows(("exact_match", 1.0, True)), rows(("exact_match", 1.0, True)), (1, 0), (1, 0), 0.05)
    names = [line.evaluator for line in report.lines]
    assert names == ["rows_ok", "truncation", "exact_match", "reference_similarity", "json_validity"]
    json_line = report.lines[-1]
    assert json_line.verdict(0.05) == "n/a" and json_line.delta == 0.0
    # A score from an evaluator the server did not list is still shown, not dropped.
    extra = compare(EVALUATORS, rows(("new_one", 1.0, True)), rows(("new_one", 1.0, True)), (1, 0), (1, 0), 0.05)
    assert extra.lines[-1].evaluator == "new_one"


def test_one_sided_scores_fail_the_gate() -> None:
    """An evaluator that scored A's rows but none of B's (or B's alone) cannot show that B holds:
    the gate fails, naming it, rather than passing on the lines that could be compared."""
    for a, b in ((rows(("reference_similarity", 0.9, True)), [[]]), ([[]], rows(("reference_similarity", 0.9, True)))):
        report = compare(EVALUATORS, a, b, (1, 0), (1, 0), 0.05)
        line = next(line for line in report.lines if line.evaluator == "reference_similarity")
        assert line.verdict(0.05) == "one side only"
        assert report.one_sided == ["reference_similarity"] and report.regressions == []
        assert report.exit_code == EXIT_REGRESSION
        verdict = render(report, Side("A", "m1"), Side("B", "m2")).splitlines()[-1]
        assert verdict == "VERDICT: FAILED: scored on one side only, so not compared: reference_similarity"
    # Lines neither side scored (n/a) still pass: nothing was measured on either.
    both = compare(EVALUATORS, rows(("exact_match", 1.0, True)), rows(("exact_match", 1.0, True)), (1, 0), (1, 0), 0.05)
    assert both.exit_code == EXIT_OK and both.one_sided == []


def test_render_shows_both_sides_and_the_verdict() -> None:
    a = rows(("exact_match", 1.0, True), ("exact_match", 1.0, True))
    b = rows(("exact_match", 0.0, False), ("exact_match", 1.0, True))
    text = render(compare(EVALUATORS, a, b, (2, 0), (2, 0), 0.05), Side("A", "m1"), Side("B", "m1", {"max_tokens": 1}))
    assert "A: m1\nB: m1 (max_tokens=1)" in text
    line = next(line for line in text.splitlines() if line.startswith("exact_match"))
    assert line.split() == ["exact_match", "higher", "1.000", "0.500", "100.0%", "50.0%", "-50.0%", "2", "2", "REGRESSED"]
    assert text.splitlines()[-1].startswith("VERDICT: REGRESSION") and "exact_match" in text.splitlines()[-1]
    json_line = next(line for line in text.splitlines() if line.startswith("json_validity"))
    assert json_line.split() == ["json_validity", "higher", "-", "-", "-", "-", "-", "0", "0", "n/a"]


def test_each_side_becomes_one_job_with_its_own_sampling() -> None:
    from sluice_cli.eval_run import job_request

    dataset = parse_dataset('{"id": "q1", "prompt": "Capital of France?", "reference": "Paris"}\n{"id": "q2", "prompt": "2+2?"}')
    a = job_request("j-a", dataset, Side("A", "m1"), max_tokens=48)
    b = job_request("j-b", dataset, Side("B", "m2", parse_sampling("max_tokens=1,temperature=1.5,seed=3")), max_tokens=48)
    assert [r.custom_id for r in a.rows] == ["q1", "q2"] and a.job_id == "j-a"
    assert a.rows[0].generate.model == "m1" and a.rows[0].generate.messages[0].content == "Capital of France?"
    assert a.rows[0].generate.sampling.max_tokens == 48 and not a.rows[0].generate.sampling.HasField("temperature")
    sampling = b.rows[1].generate.sampling
    assert (b.rows[1].generate.model, sampling.max_tokens, sampling.seed) == ("m2", 1, 3)
    assert sampling.temperature == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("sampling_b", "dataset", "said"),
    [
        ("seed=-1", b'{"prompt": "hi"}\n', "--sampling-b: "),
        ("max_tokens=9999999999", b'{"prompt": "hi"}\n', "--sampling-b: "),
        ("", b'{"prompt": "h\xffi"}\n', "not UTF-8 text"),
    ],
)
def test_a_bad_setting_or_dataset_exits_2_with_one_line_not_1_with_a_traceback(tmp_path, capsys, sampling_b: str, dataset: bytes, said: str) -> None:  # type: ignore[no-untyped-def]
    """Exit 1 means "B regressed" to a CI gate: a typo in a setting must not read as one."""
    from sluice_cli.eval_compare import EXIT_ERROR
    from sluice_cli.eval_run import cmd_eval
    from sluice_cli.main import build_parser

    path = tmp_path / "rows.jsonl"
    path.write_bytes(dataset)
    argv = ["--api-key", "sk-x", "eval", "--dataset", str(path), "--model-b", "other"] + (["--sampling-b", sampling_b] if sampling_b else [])
    assert cmd_eval(build_parser().parse_args(argv)) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("sluice eval: ") and said in err and "Traceback" not in err
