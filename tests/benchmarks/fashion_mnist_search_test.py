"""The search's candidate config parses: it includes fashion_mnist_best.gin and sets its own defaults."""

import os

import gin

from tfdp import main

CANDIDATE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks", "fashion_mnist_search", "scatternet_gnws_cnn.gin")


def _values(files, params=()):
    gin.clear_config()
    try:
        main.parse_config(files, list(params))
        return (gin.query_parameter("%WIDTH"), gin.query_parameter("%LEARNING_RATE"),
                gin.query_parameter("tfdp.EvaluationConfig.eval_every_steps"),
                gin.query_parameter("tfdp.models.build_scatternet_gnws_cnn.groups"))
    finally:
        gin.clear_config()


def test_the_candidate_is_the_best_config_with_the_search_s_defaults():
    assert _values(["fashion_mnist_best.gin"]) == (64, 0.5, 50, 27)
    assert _values([CANDIDATE]) == (128, 1.0, 25, 27)
    # The search's command line sets what it searches over.
    assert _values([CANDIDATE], ["LEARNING_RATE = 0.5", "WIDTH = 64"])[:2] == (64, 0.5)
