"""Fixtures for the trainer tests."""

from typing import List

import pytest

from megatron.training import TrainingConfig, cli


@pytest.fixture
def no_training(monkeypatch) -> List[TrainingConfig]:
    """``cli.main`` refuses or reaches ``cli._run``, which here only records the config it was
    handed (and returns 0): the list of configs that would have trained."""
    reached = []
    monkeypatch.setattr(cli, "_run", lambda config, _source=None: reached.append(config) or 0)
    return reached
