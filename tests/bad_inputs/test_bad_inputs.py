"""Runs the bad-input corpus (cases_*.py); `python3 test_bad_inputs.py` prints the
count per area, the figure docs/concepts/reliability.md states."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import all_cases, run_case  # noqa: E402

AREAS = all_cases()
PARAMS = [(area, case) for area, cases in AREAS.items() for case in cases]


def test_names_are_unique():
    names = [f"{area}/{case.name}" for area, case in PARAMS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", [c for _, c in PARAMS], ids=[f"{a}/{c.name}" for a, c in PARAMS])


def test_case(case, tmp_path):
    outcome = run_case(case, tmp_path / "case")
    assert not outcome.problems, (
        "\n".join(outcome.problems) + f"\n--- exit {outcome.rc}\n--- stdout\n{outcome.stdout[-3000:]}"
        f"\n--- stderr\n{outcome.stderr[-3000:]}")


def test_manual_states_the_count():
    page = (Path(__file__).resolve().parents[2] / "docs" / "concepts" / "reliability.md").read_text()
    total = len(PARAMS)
    assert f"{total} bad-input cases" in page, f"docs/concepts/reliability.md should say '{total} bad-input cases'"


if __name__ == "__main__":
    for area, cases in AREAS.items():
        print(f"{area:20s} {len(cases)}")
    print(f"{'total':20s} {len(PARAMS)}")
