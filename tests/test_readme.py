"""README's API example runs as printed, and prints what its comments say."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_api_example_prints_what_its_comments_say():
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    expected = [line.split("  # ", 1)[1] for line in code.splitlines() if "print(" in line]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    printed = out.getvalue().splitlines()
    assert len(printed) == len(expected)
    for got, want in zip(printed, expected, strict=True):
        assert got.startswith(want.removesuffix("...")), (got, want)
