"""(1) Prompts and (3) rewards of the RL step.

``sources`` yields question/answer rows (hub datasets, local files, the embedded arithmetic generator, mixtures),
reading local files through ``local_files`` and counting the rows it cannot use in a ``skips.SkipReport``;
``prompts`` turns them into chat-formatted, tokenized, sharded, resumable batches (``MathPromptDataModule``);
``answers`` extracts and compares final answers; ``rewards`` scores completions under a time limit
(``timeout_pool``) and shapes overlong ones, with the user's functions (``user_rewards``) beside the math reward or,
verl's way, in its place (``custom_reward``).
"""
