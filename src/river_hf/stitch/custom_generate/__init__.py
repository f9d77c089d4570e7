"""Folder transformers' ``custom_generate`` mechanism loads (``custom_generate/generate.py``).

Pass its parent, :data:`river_hf.stitch.CUSTOM_GENERATE_DIR`, as ``custom_generate=`` to
``model.generate`` together with ``trust_remote_code=True`` (transformers 5 requires it for local
folders too). This ``__init__`` only makes setuptools ship ``generate.py`` inside the package.
"""
