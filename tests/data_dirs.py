"""Where the tests find real data: the one place that names these folders.

SHIPPED is tests/data (GPT-2 BPE files and real English text, provenance and licences in its SOURCE.md), so a
fresh clone runs every test. UNSHIPPED is ../shared/data next to the checkout: the few data sets that may not be
redistributed with megapar; the tests that read them skip with a reason when it is absent (tests/standin_data.py
builds stand-ins so that the properties they check are tested anyway). MEGAPAR_UNSHIPPED_DATA names another
folder for it (a checkout elsewhere; or a missing folder, to run the tests as a fresh clone would).
"""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "tests" / "data"
GPT2_DIR = SHIPPED / "gpt2"
UNSHIPPED = Path(os.environ.get("MEGAPAR_UNSHIPPED_DATA") or ROOT.parent / "shared" / "data")
