"""Looking at a run: token-by-token replay (`replay.py`), the HTML page (`html.py`), the metrics
table and curves and the record checks (`curves.py`)."""
