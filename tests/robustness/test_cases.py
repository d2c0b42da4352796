"""Every case of the robustness catalogue ends as it must: a clear error (exit code, one line naming the
cause, no traceback) or a correct result, and no previous artifact is damaged (see robustness_cases)."""

from __future__ import annotations

import pytest
from robustness_cases import Fixtures, catalogue, run_case

CASES = catalogue()


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Fixtures:
    return Fixtures(tmp_path_factory.mktemp("robustness")).build()


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case, fx: Fixtures, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EQJAX_CACHE", str(fx.root / "cache"))
    outcome, detail, _ = run_case(case, fx, tmp_path / "work")
    want = "clear error" if case.expect == "error" else "correct"
    assert outcome == want, f"{case.name}: {outcome}: {detail}"
