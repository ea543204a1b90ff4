"""The deltasync trainer: TRL async GRPO on Wordle, publishing weight deltas to a bucket."""
