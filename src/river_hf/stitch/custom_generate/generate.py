"""R-Stitch as a transformers ``custom_generate`` recipe.

Usage (the LLM is the model ``generate`` is called on; the SLM is passed as ``assistant_model``)::

    import river_hf.stitch
    out = llm.generate(
        input_ids,
        custom_generate=river_hf.stitch.CUSTOM_GENERATE_DIR,
        trust_remote_code=True,      # transformers 5 asks for it for local folders as well
        assistant_model=slm,
        tau=0.02,
        max_new_tokens=128,
    )

transformers (``GenerationMixin.generate``, step 0.a) loads ``custom_generate/generate.py`` from the
folder, skips its own input preparation and calls ``generate(model=llm, **all_generate_arguments)``;
this function forwards them to :func:`river_hf.stitch.generate` (``streamer``,
``prefix_allowed_tokens_fn``, ``logits_processor``, ``stopping_criteria``, ``generation_config`` and
every ``GenerationConfig`` field included). ``negative_prompt_ids`` /
``negative_prompt_attention_mask`` (classifier-free guidance, which R-Stitch does not do) raise a
``RiverError`` when set.
"""

from river_hf.errors import RiverError
from river_hf.stitch.generation import generate as _stitch_generate

_UNSUPPORTED = ("negative_prompt_ids", "negative_prompt_attention_mask")


def generate(model, inputs=None, assistant_model=None, tau=None, synced_gpus=None, **kwargs):
    """``custom_generate`` entry point: ``model`` is the LLM, ``assistant_model`` the SLM.

    Returns what :func:`river_hf.stitch.generate` returns (``LongTensor [1, L]`` or a
    ``StitchOutput`` with ``return_dict_in_generate=True``).

    Raises:
        RiverError: no ``assistant_model`` or no ``tau``, or an unsupported argument is set.
    """
    if assistant_model is None:
        raise RiverError("R-Stitch via custom_generate needs the SLM as assistant_model=")
    if tau is None:
        raise RiverError("R-Stitch via custom_generate needs tau= (normalized-entropy threshold, e.g. 0.02)")
    for name in _UNSUPPORTED:
        if kwargs.pop(name, None) is not None:
            raise RiverError(
                f"R-Stitch does not support {name} (it has no classifier-free guidance); drop it or use plain generate"
            )
    input_ids = kwargs.pop("input_ids", None)
    if input_ids is None:
        input_ids = inputs
    if input_ids is None:
        raise RiverError("pass the prompt token ids (input_ids) to generate")
    return _stitch_generate(assistant_model, model, input_ids, tau=float(tau), **kwargs)
