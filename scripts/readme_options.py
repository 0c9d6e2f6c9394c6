"""Write the README's option tables again from the command line's own
declarations (``redrafter_mlx.cli.option_tables``); a test checks that the
README holds them as this script writes them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redrafter_mlx.cli import render_readme  # noqa: E402

readme = Path(__file__).resolve().parent.parent / "README.md"
text = readme.read_text()
rendered = render_readme(text)
if rendered != text:
    readme.write_text(rendered)
    print(f"{readme}: option tables written")
else:
    print(f"{readme}: option tables already current")
