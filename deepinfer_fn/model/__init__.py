"""Pure functions of the DeepSeek-V4 forward pass (spec/model.md §2)."""
