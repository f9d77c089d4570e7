"""``river-hf serve``: River's own OpenAI-compatible HTTP server (FastAPI + uvicorn) on a River model.

:mod:`.cli` registers the subcommand (no heavy import); :mod:`.requests` checks a request body and
turns it into generation settings; :mod:`.scheduler` is the one inference thread (batching or
FIFO); :mod:`.app` is the FastAPI app. They need the ``serve`` extra (``pip install
"river-hf[serve]"``: fastapi, uvicorn). Nothing is imported here, so ``import river_hf`` works
without them.
"""
