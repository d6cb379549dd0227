"""Pure functions of the DeepSeek-V4 forward pass (docs/MODEL.md §2)."""
