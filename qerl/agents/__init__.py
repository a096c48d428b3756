"""Multi-turn episodes: the model calls tools or acts on an environment, reads the result and goes on.

    config.py    ``model.agent``: tools, environment, chat template, limits
    runner.py    the run's tools and environment, checked against the chat template
    episode.py   the episode loop over any rollout engine -> one ``Rollout`` with the model's tokens marked
    metrics.py   turns, tool calls, failures, tool time, ends; one episode as text
"""
