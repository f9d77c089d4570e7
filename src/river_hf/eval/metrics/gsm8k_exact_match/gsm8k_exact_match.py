"""GSM8K exact match, as an `evaluate` metric module that loads by path (no Hub access).

Load with ``evaluate.load(river_hf.eval.metrics.path("gsm8k_exact_match"))``.

Both predictions and references are free text (a model's worked solution; GSM8K's reference
solution ending in ``#### <answer>``). Each is reduced to its final number by
:func:`extract_answer` and the two numbers are compared exactly (after dropping thousands
separators, currency signs and trailing zeros of a decimal part).

Source: GSM8K (Cobbe et al., 2021), answers after ``####``; the last-number fallback is the
common convention of evaluation harnesses for chat models.
"""

import re

import datasets
import evaluate

_DESCRIPTION = "Exact match of the final numeric answer of GSM8K solutions (#### form, 'answer is' form, else last number)."
_KWARGS = """
Args:
    predictions (list of str): model outputs.
    references (list of str): reference solutions (or bare answers).
Returns:
    exact_match (float): fraction of predictions whose extracted answer equals the reference's.
    extracted (list of str or None): the answer extracted from each prediction.
"""
_CITATION = "Cobbe et al., Training Verifiers to Solve Math Word Problems, 2021."

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?"


def normalize_number(text):
    """Canonical form of a number string: no ``$``/``,``/spaces, no trailing ``.0``; None if not a number."""
    if text is None:
        return None
    s = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return None
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def extract_answer(text):
    """Final numeric answer of a GSM8K solution text, normalized; None when it holds no number.

    Order: the number after the last ``####``; else after the last "answer is"/"answer:"; else
    the last ``\\boxed{...}`` number; else the last number in the text.
    """
    if text is None:
        return None
    for pattern in (r"####\s*(" + _NUMBER + ")", r"answer\s*(?:is|:)\s*[:=]?\s*\**\s*(" + _NUMBER + ")",
                    r"\\boxed\{\s*(" + _NUMBER + r")\s*\}"):
        found = re.findall(pattern, text, flags=re.IGNORECASE)
        if found:
            return normalize_number(found[-1])
    found = re.findall(_NUMBER, text)
    return normalize_number(found[-1]) if found else None


class Gsm8kExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        extracted = [extract_answer(p) for p in predictions]
        gold = [extract_answer(r) for r in references]
        hits = [e is not None and e == g for e, g in zip(extracted, gold)]
        return {
            "exact_match": sum(hits) / len(hits) if hits else 0.0,
            "extracted": extracted,
            "gold": gold,
        }
