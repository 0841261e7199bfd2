"""``sluice bench goodput --matrix``, tiny: the cells, the command end to end, its refusals of bad options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.cli.app import app
from sluice_lab.cli.goodput_matrix import build_matrix
from sluice_lab.goodput import CLIENT_LIMITED, LIMITED, NO_LIMITER, VARIANTS, GoodputSpec
from sluice_lab.goodput_matrix import Cell, Matrix, cell_specs, cell_timeout, meets_target

runner = CliRunner()


def test_the_full_matrix_has_every_cell_once_the_variants_of_a_condition_together() -> None:
    cells = Matrix().cells()
    assert len(cells) == 3 * 2 * 3 * 2 == len(set(cells))
    assert [c.variant for c in cells[:3]] == list(VARIANTS)
    assert {(c.processes, c.network_delay_ms, c.count_rejected) for c in cells[:3]} == {(1, 0.0, False)}
    # Narrowed: only the values given, and repeats count once.
    narrow = build_matrix([LIMITED], [2, 2], [5.0], [True])
    assert narrow.cells() == [Cell(LIMITED, 2, 5.0, True)]
    assert build_matrix([NO_LIMITER], None, None, None).count_rejected == (False, True)
    spec = Cell(CLIENT_LIMITED, 2, 50.0, True).spec(GoodputSpec(processes=1))
    assert (spec.processes, spec.network_delay, spec.count_rejected) == (2, 0.05, True)
    # Twice the theoretical minimum (1,000 calls: about 10.3 s, the tokens bind) and 10 s.
    assert cell_timeout(GoodputSpec(jobs=1000)) == pytest.approx(2 * 10.35 + 10, abs=0.2)


def test_a_cell_meets_the_target_only_complete_without_429_at_97_percent() -> None:
    ok = {"complete": True, "rate_limited": 0, "goodput_pct": 97.0}
    assert meets_target(ok)
    assert not meets_target({**ok, "rate_limited": 1})
    assert not meets_target({**ok, "goodput_pct": 96.99})
    assert not meets_target({**ok, "complete": False})
    assert not meets_target({**ok, "goodput_pct": None})


def test_bad_matrices_are_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        Matrix(variants=("nope",))
    with pytest.raises(ValueError, match="network_delay must be"):
        Matrix(network_delay_ms=(20_000.0,))
    with pytest.raises(ValueError, match="at least one value"):
        Matrix(processes=())
    # aiolimiter's share of 1,000 tokens over 4 processes is smaller than one call.
    with pytest.raises(ValueError, match="must exceed the largest call"):
        cell_specs(GoodputSpec(tokens=1000), Matrix(variants=(CLIENT_LIMITED,), processes=(4,)))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--network-delay-ms", "-5"], "--network-delay-ms"),
        (["--network-delay-ms", "20000"], "--network-delay-ms"),
        (["--network-delay-ms", "nan"], "--network-delay-ms"),
        (["-p", "1", "-p", "2"], "--processes takes one value without --matrix"),
        (["--network-delay-ms", "0", "--network-delay-ms", "5"], "--network-delay-ms takes one value"),
        (["--no-pacer", "--tolerance-ms", "5"], "give tolerance_ms or pacer=False, not both"),
        (["--variant", "nope"], "unknown variant 'nope'"),
        (["--matrix", "--variant", "aiolimiter", "-p", "4", "--tpw", "1000"], "must exceed the largest call"),
        (["--variant", "aiolimiter", "-p", "4", "--tpw", "1000"], "must exceed the largest call"),
    ],
)
def test_bad_options_are_a_clear_usage_error(args: list[str], message: str, tmp_path: Path) -> None:
    # Refused before any server starts: a bogus Redis URL is never dialled.
    env = {"COLUMNS": "200", "SLUICE_REDIS_URL": "redis://127.0.0.1:1/0"}
    result = runner.invoke(app, ["bench", "goodput", *args, "--json", str(tmp_path / "x.json")], env=env)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_a_tiny_matrix_writes_every_cell_to_json_and_a_png(tmp_path: Path) -> None:
    # Given 40 calls per cell and a provider allowing 40 requests per second (all fit one window)
    out = tmp_path / "matrix.json"
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"}  # a throw-away Redis
    env["COLUMNS"] = "220"
    # When the matrix runs sluice-limited on 1 process with 0 and 30 ms of network delay
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "sluice", "bench", "goodput", "--matrix", "--jobs", "40"),
            *("--variant", LIMITED, "-p", "1", "-c", "8", "--free-rejected"),
            *("--network-delay-ms", "0", "--network-delay-ms", "30"),
            *("--rpw", "40", "--tpw", "60000", "--latency", "0.02", "--latency-per-token", "0"),
            *("--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Then the JSON holds both cells, each with its full result, and the spec
    data = json.loads(out.read_text())
    assert data["spec"]["jobs"] == 40 and data["target_pct"] == 97.0
    assert [(c["variant"], c["network_delay_ms"]) for c in data["cells"]] == [(LIMITED, 0.0), (LIMITED, 30.0)]
    for cell in data["cells"]:
        r = cell["result"]
        assert r["warnings"] == []
        assert (r["completed"], r["duplicates"], r["lost_or_failed"]) == (40, 0, 0)
        assert r["provider"]["limits"]["network_delay"] == cell["network_delay_ms"] / 1000
        assert cell["meets_target"] == meets_target(r)
    # and the network's delay shows between dispatch and arrival, in the cell that has it,
    near, far = (c["result"]["dispatch_to_arrival"]["p50_ms"] for c in data["cells"])
    assert far >= 30 and far > near
    # the table, and a PNG beside the JSON.
    text = " ".join(proc.stdout.split())
    assert "Goodput matrix: 40 LLM calls per cell" in text and "of 2 cells meet the target" in text
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
