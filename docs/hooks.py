"""MkDocs hook: draw the performance page's plots from the committed benchmark JSON at every build.

The PNGs are not committed: docs/plots.py draws them into a temporary directory and they are added
to the site as generated files under img/, so a plot never drifts from bench/results/*.json.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_tmp = tempfile.TemporaryDirectory(prefix="tiercheck-plots-")


def on_files(files: Files, config: Any) -> Files:
    spec = importlib.util.spec_from_file_location("tiercheck_docs_plots", Path(__file__).with_name("plots.py"))
    assert spec is not None and spec.loader is not None
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    out = Path(_tmp.name)
    for name in plots.draw(out):
        files.append(File.generated(config, f"img/{name}", abs_src_path=str(out / name)))
    return files
