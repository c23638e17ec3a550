"""Every relative link in README.md and docs/ resolves: a markdown link ``[text](path#anchor)`` names a file that
exists (relative to the page) and, with an anchor, a heading of that file (GitHub's slug); a bare repository path
to a page (``docs/measurements.md`` in prose) names a file that exists. Moving text between README and docs/
must not leave a reader at a dead link. The checker runs on a synthetic tree with broken links too, so a checker
that cannot fail fails here."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BARE = re.compile(r"(?<![\w/.\-])(docs/[\w./\-]+\.(?:md|txt|csv|png))")
FENCE = re.compile(r"^(```|~~~)")
#: bare paths that name another project's files, not ours: triton-ascend's documentation, quoted in docs/ascend.md
FOREIGN = {"docs/zh/triton_api/Math_Ops/fma.md", "docs/en/environment_variable_reference.md",
           "docs/en/migration_guide/migrate_from_gpu.md"}


def pages(root: str) -> list[str]:
    out = [os.path.join(root, "README.md")]
    for dirpath, _, files in os.walk(os.path.join(root, "docs")):
        out += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".md")]
    return [p for p in out if os.path.isfile(p)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, '-', '_' and spaces
    kept), spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    found, seen, fenced = set(), {}, False
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if FENCE.match(line):
                fenced = not fenced
            if fenced or not line.startswith("#"):
                continue
            s = slug(line.lstrip("#"))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def broken_links(root: str) -> list[str]:
    bad = []
    for page in pages(root):
        with open(page, encoding="utf-8") as fh:
            text = fh.read()
        rel = os.path.relpath(page, root)
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.\-]*:", target):  # http:, https:, mailto: -- not checked here
                continue
            path, _, anchor = target.partition("#")
            dest = page if not path else os.path.normpath(os.path.join(os.path.dirname(page), path))
            if not os.path.exists(dest):
                bad.append(f"{rel}: [{target}] -> no file {os.path.relpath(dest, root)}")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                bad.append(f"{rel}: [{target}] -> no heading #{anchor} in {os.path.relpath(dest, root)}")
        for path in BARE.findall(LINK.sub("", text)):  # a link's own target was checked above
            if path not in FOREIGN and not os.path.exists(os.path.join(root, path)):
                bad.append(f"{rel}: {path} -> no such file")
    return bad


def test_every_relative_link_in_readme_and_docs_resolves():
    assert broken_links(ROOT) == []


def test_the_checker_catches_a_missing_file_a_missing_heading_and_a_dead_bare_path(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Page A\n\n## The two commands: what runs\n\n```\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#the-two-commands-what-runs) [web](https://example.com/x.md)\n"
        "[gone](docs/b.md) [no heading](docs/a.md#not-a-heading) see docs/c.md and docs/a.md\n")
    assert broken_links(tmp_path) == ["README.md: [docs/b.md] -> no file docs/b.md",
                                      "README.md: [docs/a.md#not-a-heading] -> no heading #not-a-heading in docs/a.md",
                                      "README.md: docs/c.md -> no such file"]
