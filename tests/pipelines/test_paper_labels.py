"""Every table, figure, section, appendix, equation and algorithm a config's `paper:` section cites exists in the
paper text it cites, and every quotation in it ("...") is the paper's own words.

The papers are read from ``../shared/papers`` beside the repository (where CI keeps ``shared/``); without them the
tests are skipped, saying where they looked.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
PAPERS = REPO.parent / "shared" / "papers"
ALL_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml"))

PAPER_2026 = "stationary-compatible-representation-2026.txt"
PAPER_IAM = "iam-cl2r-cvpr-2024.txt"
PAPER_CORES = "cores-tpami-2023.txt"
PAPER_PSP = "probability-simplex-is-compatible.txt"
# which papers a config's citations may refer to (the numbering styles differ: the 2026 paper's tables are Roman)
PAPER_CL2R = "cl2r-tomm-2023.txt"
CITED_PAPERS = {"cl2r-": [PAPER_2026, PAPER_CL2R], "iam-cl2r-": [PAPER_2026, PAPER_IAM], "demo-": [PAPER_2026, PAPER_IAM],
                "cores-": [PAPER_CORES], "psp-": [PAPER_PSP], "lsp-": [PAPER_PSP]}

CITATION = re.compile(
    r"\b(?P<kind>Table|Tab\.|Figure|Fig\.|Sec\.|Appendix|App\.|Eq\.|Alg\.)\s+"
    r"(?P<label>[IVX]+\b|\d+(?:\.\d+)*|[A-G]\b)(?P<panels>(?:\([a-z]\)(?:-\([a-z]\))?)?)")
QUOTE = re.compile(r'"([^"]{10,})"')


def _papers_for(name: str) -> list[str]:
    for prefix, papers in CITED_PAPERS.items():
        if name.startswith(prefix):
            return papers
    raise AssertionError(f"{name}: no paper mapping; add its prefix to CITED_PAPERS")


def _read(paper: str) -> str:
    path = PAPERS / paper
    if not path.is_file():
        pytest.skip(f"paper text {path} not found (CI keeps shared/papers beside the repository clone)")
    return path.read_text(encoding="utf-8")


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _caption_spans(text: str, kind: str, label: str) -> list[tuple[int, int]]:
    """Where the labelled item is defined in the paper text (caption, heading, numbered equation ...)."""
    escaped = re.escape(label)
    patterns = {
        "table": rf"(?:TABLE|Table)\s+{escaped}\b",
        "figure": rf"(?:Figure\s+{escaped}:|Fig\.\s+{escaped}\.)",
        "section": rf"(?m)^{escaped}\.?\s+[A-Z]",
        "appendix": rf"(?m)^(?:Appendix\s+{escaped}\b|{escaped}\s+[A-Z]{{3,}})",
        "equation": rf"(?m)(?:^\({escaped}\)\s*$|\\tag\{{{escaped}\}})",
        "algorithm": rf"Algorithm\s+{escaped}\b",
    }
    return [m.span() for m in re.finditer(patterns[kind], text)]


KINDS = {"Table": "table", "Tab.": "table", "Figure": "figure", "Fig.": "figure", "Sec.": "section",
         "Appendix": "appendix", "App.": "appendix", "Eq.": "equation", "Alg.": "algorithm"}


def _label_found(texts: list[str], kind: str, label: str, panels: list[str]) -> bool:
    for text in texts:
        for start, end in _caption_spans(text, kind, label):
            # sub-panels (a), (h)-(i): named near the caption (captions list them, panels sit just above)
            window = text[max(0, start - 3000): end + 3000]
            if all(f"({panel})" in window for panel in panels):
                return True
    return False


def _paper_strings(document: dict) -> list[str]:
    paper = document.get("paper") or {}
    return [paper.get("reproduces", "")] + [item for key in ("divergences", "public_code", "choices",
                                                                         "public_code_differences")
                                            for item in paper.get(key, [])]


def test_every_config_has_a_paper_section():
    for name in ALL_CONFIGS:
        document = yaml.safe_load((CONFIGS / name).read_text())
        assert document.get("paper", {}).get("reproduces"), f"{name}: no paper.reproduces"


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_cited_labels_exist_in_the_papers(name):
    texts = [_read(paper) for paper in _papers_for(name)]
    document = yaml.safe_load((CONFIGS / name).read_text())
    cited = 0
    for item in _paper_strings(document):
        for match in CITATION.finditer(item):
            kind, label = KINDS[match["kind"]], match["label"]
            panels = re.findall(r"\(([a-z])\)", match["panels"])
            if len(panels) == 2:  # (h)-(i): every panel of the range
                panels = [chr(c) for c in range(ord(panels[0]), ord(panels[1]) + 1)]
            assert _label_found(texts, kind, label, panels), (
                f"{name}: cites {match.group(0)!r}, not found in {_papers_for(name)}")
            cited += 1
    assert cited >= 1, f"{name}: the paper section cites no table, figure or section"


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_quotations_are_the_papers_words(name):
    texts = [_normalised(_read(paper)) for paper in _papers_for(name)]
    document = yaml.safe_load((CONFIGS / name).read_text())
    for item in _paper_strings(document):
        for quote in QUOTE.findall(item):
            assert any(_normalised(quote) in text for text in texts), f"{name}: quote not in the paper: {quote!r}"


def test_the_checker_rejects_labels_the_papers_do_not_have():
    """The two wrong references the configs carried (a CL2R "Sec. 5.4", CoReS' "Fig. 6" for the CIFAR result) and
    a panel the figure does not have are refused; the right ones are found."""
    paper_2026, cores = [_read(PAPER_2026)], [_read(PAPER_CORES)]
    assert not _label_found(paper_2026, "section", "5.4", [])
    assert _label_found(paper_2026, "section", "6", []) and _label_found(paper_2026, "section", "5.3", [])
    assert _label_found(cores, "figure", "5", list("hi")) and not _label_found(cores, "figure", "5", ["k"])
    assert "CIFAR" not in _normalised(cores[0]).split("Fig. 6. ")[1][:200]  # CoReS Fig. 6 is the LFW result
    assert _label_found(paper_2026, "table", "VII", []) and not _label_found(paper_2026, "table", "XI", [])


def test_method_cards_quote_only_the_papers_words():
    """A baseline card's paper lines (printed by `compat plan`) quote only sentences found in the paper set."""
    from pipelines.methods import METHODS

    texts = [_normalised(_read(paper)) for paper in (PAPER_2026, PAPER_IAM, PAPER_CL2R, PAPER_CORES, PAPER_PSP)]
    quoted = 0
    for name in METHODS.names():
        for item in METHODS.get(name).paper:
            for quote in QUOTE.findall(item):
                assert any(_normalised(quote) in text for text in texts), f"{name}: quote not in the papers: {quote!r}"
                quoted += 1
    assert quoted >= 2
