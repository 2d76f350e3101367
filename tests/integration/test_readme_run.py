"""The README's `miles.train` example (section "Real runs"), as a doc test: its code block runs
with two changes only, the session's tiny model instead of the built-in warm start and two steps
instead of twenty, in a temporary folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = re.search(r"### Real runs: `miles run` and `miles.train`\n(.*?)\n## ",
                    (ROOT / "README.md").read_text(), re.DOTALL).group(1)


def test_the_readme_train_example_runs(model_dir, tmp_path, monkeypatch, capsys):
    code = re.search(r"```python\n(.*?)```", SECTION, re.DOTALL).group(1)
    for written, changed in (('algo="grpo",', f'algo="grpo", model={str(model_dir)!r},'),
                             ("max_steps=20", "max_steps=2")):
        assert written in code
        code = code.replace(written, changed)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    accuracy, policy = printed.split(" ", 1)
    assert 0.0 <= float(accuracy) <= 1.0
    assert Path(policy) == Path("runs/notebook/policy") and (tmp_path / policy / "config.json").exists()
