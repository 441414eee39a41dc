"""`draftsmith pipeline CONFIG.yaml` and `draftsmith demo`: every stage from one validated config, resumable."""
