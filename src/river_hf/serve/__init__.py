"""``river-hf serve``: transformers' own OpenAI-compatible server (``transformers serve``) with the
model loaded through River's ``from_pretrained``.

:mod:`.cli` registers the subcommand (no heavy import); :mod:`.app` wires River into
``transformers.cli.serving`` (it needs the ``serve`` extra: ``pip install "river-hf[serve]"``, i.e.
``transformers[serving]``). Nothing is imported here, so ``import river_hf`` works without them.
"""
