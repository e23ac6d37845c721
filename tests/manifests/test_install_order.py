"""Every install recipe in the docs works from an empty cluster: the CRDs
(`manifests/crds`) before the operator (`manifests/base`), and no text saying that
`manifests/base` installs the CRDs (it holds none: `test_argocd.py`). Issue #45,
finding 3: four README recipes and an example's comment said so, and a new user's
first pool was refused ("no matches for kind").

Checked paragraph by paragraph (text between blank lines; in YAML, a block of comment
lines; a shell script as a whole), so a recipe is read as a user reads it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import MANIFESTS, REPO

DOCS = sorted({
    REPO / "README.md", REPO / "e2e" / "README.md", REPO / "e2e" / "setup.sh",
    *(REPO / "docs").glob("*.md"), *MANIFESTS.rglob("*.md"), *MANIFESTS.rglob("*.yaml"),
})
# `-k manifests/base`, also as `-k "${REPO}/manifests/base"` in a script.
_BASE = re.compile(r"-k\s+\"?(?:\$\{\w+\}/)?manifests/base\b")
_CRDS = re.compile(r"-k\s+\"?(?:\$\{\w+\}/)?manifests/crds\b")
_DELETE = re.compile(r"\bdelete\s+(?:\S+\s+)*$")
_NEGATION = re.compile(r"\b(no|not|never|none|without)\b", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.;:])\s+")
# "manifests/base installs (holds, ...) the CRDs", as a claim about base itself.
_BASE_HOLDS = re.compile(r"manifests/base`?\s+(?:\w+\s+)?(?:installs|holds|contains|"
                         r"includes|has|brings)\b[^.;]*\bCRD")


def paragraphs(text: str, suffix: str) -> list[str]:
    if suffix == ".sh":
        return [text]
    if suffix == ".yaml":
        blocks, current = [], []
        for line in text.splitlines():
            stripped = line.strip()
            if stripped.startswith("#") and stripped.strip("#").strip():
                current.append(stripped.lstrip("#").strip())
            elif current:
                blocks.append(" ".join(current))
                current = []
        return [*blocks, " ".join(current)] if current else blocks
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def base_before_crds(paragraph: str) -> bool:
    """Whether an apply of manifests/base comes without the CRDs applied before it."""
    for match in _BASE.finditer(paragraph):
        command = paragraph[:match.start()].rsplit("`", 1)[-1].rsplit("\n", 1)[-1]
        if _DELETE.search(command):
            continue
        if not _CRDS.search(paragraph[:match.start()]):
            return True
    return False


def says_base_installs_crds(paragraph: str) -> bool:
    """A sentence that applies manifests/base and names CRDs without applying
    manifests/crds, or says manifests/base installs them; unless negated ("holds no
    CRD", "deletes no CRD")."""
    return any(
        ((_BASE.search(sentence) and "CRD" in sentence and not _CRDS.search(sentence))
         or _BASE_HOLDS.search(sentence))
        and not _NEGATION.search(sentence)
        for sentence in _SENTENCE_END.split(paragraph)
    )


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_install_the_crds_before_the_operator(path: Path) -> None:
    wrong = [p for p in paragraphs(path.read_text(), path.suffix)
             if base_before_crds(p) or says_base_installs_crds(p)]
    assert wrong == [], (f"{path.relative_to(REPO)}: apply -k manifests/crds before -k "
                         "manifests/base, and manifests/base holds no CRD")


def test_the_checks_catch_what_the_docs_said_before() -> None:
    # README's recipes and the gpu-engine example's comment until #45.
    recipe = ("Three steps, whatever installed vLLM. Steps 1 and 2 are the same for every "
              "method: (1) the operator, its CRDs and the webhook, `kubectl apply "
              "--server-side -k\nmanifests/base` (with cert-manager: `-k "
              "manifests/overlays/cert-manager`, see below);")
    assert says_base_installs_crds(recipe)
    assert base_before_crds(recipe)
    assert base_before_crds("**KServe**\n1. `kubectl apply --server-side -k manifests/base`\n"
                            "2. the pool, tenants and Secret")
    (comment,) = paragraphs("\n".join([
        "# The sample pool and tenants served by one GPU engine:",
        "#   kubectl apply -k manifests/base          # operator, CRDs and the webhook",
        "apiVersion: v1"]), ".yaml")
    assert says_base_installs_crds(comment) and base_before_crds(comment)
    # ... and let the right order, and an uninstall, through.
    assert not base_before_crds("`kubectl apply --server-side -k manifests/crds`, then "
                                "`kubectl apply --server-side -k\n   manifests/base`")
    assert not base_before_crds("Removing the operator: `kubectl delete -k manifests/base`")
    assert not says_base_installs_crds("`kubectl delete -k manifests/base` deletes no CRD.")
    assert says_base_installs_crds("Then `manifests/base` also installs the CRDs.")
    assert not says_base_installs_crds("It installs the CRDs and `manifests/base` in the "
                                       "order above.")

