"""Sphinx configuration of dtshard's documentation site.

Build (from the repository root; warnings are errors, so a broken cross-reference fails):

    pip install -e ".[docs]"
    python -m sphinx -W -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import dtshard  # noqa: E402  (the version, and autodoc imports it anyway)

project = "dtshard"
author = "The dtshard authors"
copyright = "The dtshard authors"  # noqa: A001 (Sphinx's name)
release = dtshard.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# ARCHITECTURE.md is included by architecture.md (it stays where tests/unit/test_import_graph.py reads it)
exclude_patterns = ["_build", "ARCHITECTURE.md", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4          # links to a page's sections: [text](page.md#a-heading)

# the API pages hold every name themselves (autosummary tables + autodoc directives): no stub page
# per name, which made the build twice as slow (furo computes every page's navigation tree)
autosummary_generate = False
autosummary_imported_members = False
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False


html_theme = "furo"
html_title = f"dtshard {release}"
html_static_path = ["_static"]
html_css_files = ["dtshard.css"]
html_theme_options = {
    "source_edit_link": None,
    "navigation_with_keys": True,
}
pygments_style = "friendly"
pygments_dark_style = "monokai"


_SETTING_DOCS: dict[str, list[str]] = {}


def _keep_setting_doc(app, what, name, obj, options, lines):
    """napoleon reads the first line of an attribute's doc as ``type: description``; the settings'
    comments often start with ``Something (where): what it does``, which is no type. Keep each
    setting's text before napoleon runs (priority 100) and put it back after (priority 900)."""
    if what == "attribute" and name.startswith("dtshard.config."):
        _SETTING_DOCS[name] = list(lines)


def _restore_setting_doc(app, what, name, obj, options, lines):
    if what == "attribute" and name in _SETTING_DOCS:
        lines[:] = _SETTING_DOCS.pop(name)


def setup(app):
    app.connect("autodoc-process-docstring", _keep_setting_doc, priority=100)
    app.connect("autodoc-process-docstring", _restore_setting_doc, priority=900)
