"""Agent RL's own parts (chapter 8.5 with tools): the multi-turn rollout, the tools it may call, the rewards."""
