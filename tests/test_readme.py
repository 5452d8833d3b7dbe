"""README starts with exactly the two quickstart commands, and .ci/run runs the second."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_commands_and_ci():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    assert len(blocks) >= 2
    first, second = blocks[0].strip(), blocks[1].strip()
    assert first.startswith("pip install") and "moekit" in first
    assert "pytest" in second
    # the commands come first: only the title precedes them
    head = text.split("```bash")[0].strip().splitlines()
    assert head == ["# moekit"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in ci


def test_test_files_collect_without_the_optional_extras():
    """`pytest` collects without the test extra's hypothesis or triton: property tests import
    through hypothesis_or_skip, and files importing the Triton kernels at the top skip first."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "hypothesis_or_skip.py":
            continue
        lines = path.read_text().splitlines()
        top = [line for line in lines if line.startswith(("import ", "from "))]
        assert not [line for line in top if re.match(r"(from|import) hypothesis\b", line)], path
        triton = r"(from|import) (moekit\.kernels|triton)\b"
        kernels = next((i for i, line in enumerate(lines) if re.match(triton, line)), None)
        if kernels is not None:
            guard = [i for i, line in enumerate(lines[:kernels]) if re.match(r"(\w+ = )?pytest\.importorskip\(", line)]
            assert guard, f"{path}: imports triton at module level without pytest.importorskip first"


def test_elastic_example_commands_fit_every_stage_of_the_scenario():
    """The docstring's commands of examples/elastic_ep.py give worlds of 4, 2 and 3 ranks that the
    capacity rule accepts (--experts 16 --redundant 4 was refused at the 2-rank stage)."""
    import importlib.util  # noqa: PLC0415
    import shlex  # noqa: PLC0415

    from moekit.elastic import validate_request  # noqa: PLC0415

    path = ROOT / "examples" / "elastic_ep.py"
    spec = importlib.util.spec_from_file_location("elastic_ep_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    commands = [line.split("examples/elastic_ep.py", 1)[1] for line in example.__doc__.splitlines()
                if line.strip().startswith("python examples/elastic_ep.py")]
    assert len(commands) >= 2
    for command in commands:
        args = example.parse(shlex.split(command))
        four = [f"w{i}" for i in range(4)]
        for keep, add in ((four, 0), (four[:2], 0), (four[:2], 1)):
            validate_request(four, keep, add, num_experts=args.experts, num_redundant=args.redundant,
                             max_slots_per_rank=args.max_slots)
