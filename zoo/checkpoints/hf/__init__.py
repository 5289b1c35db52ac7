"""Hugging Face configs and names: ``config.json`` <-> spec through a format per ``model_type``
(format.py, fields.py, common.py, sizes.py, formats/), and the two-way weight-name maps (maps.py, mtp.py)."""
