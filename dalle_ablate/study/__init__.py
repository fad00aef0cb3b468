"""`dalle-ablate study`: how a study runs -- its runs as child processes of the study process
(`children.py`), what they would meet, checked before any starts (`checks.py`), its stress runs
(`stress_runs.py`), its top-ups (`topup.py`), and the whole of it with its report, its page and the
page's provenance (`runner.py`). What a study is -- its file, findings, stress plan, and the arms
and seeds its preset runs -- is report/study_file.py; how its runs are judged and written up is the
rest of report/, which knows nothing of this package or of the trainer."""
