"""The DeepInfer version: plans record it, and a plan from another version is refused."""
VERSION = "0.1.0"
