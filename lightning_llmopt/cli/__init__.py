"""The `llmopt` command line (LightningCLI)."""
