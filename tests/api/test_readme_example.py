"""The README's example of jaxzero.Engine runs as written, in a fresh process."""

import re

import pytest

from processes import ROOT, run_python


@pytest.mark.slow  # a fresh process compiles the step
def test_the_readme_example_runs_as_written(tmp_path):
  readme = (ROOT / "README.md").read_text()
  (code,) = re.findall(r"<!-- example: any model -->\n```python\n(.*?)```", readme, re.S)
  result = run_python("-c", code, cwd=tmp_path,
                      env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
  assert result.returncode == 0, result.stderr[-3000:]
  loss, state_bytes = result.stdout.split()
  assert float(loss) > 0 and int(state_bytes) > 0
  assert (tmp_path / "runs" / "mlp" / "checkpoints" / "1").is_dir()
  assert "wider than precision" not in result.stderr  # it computes in bfloat16, as it says
