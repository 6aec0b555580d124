"""``python -m bench``: run the whole bench suite and write bench/results/report.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_all import main

main()
