"""The jobs and the command line: ``cli.py`` over the extraction job (``extract/``) and the training jobs
(``train/``), over ``export/`` (``actlake export``) and ``common/`` (what every job uses)."""
