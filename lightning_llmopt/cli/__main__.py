from lightning_llmopt.cli.main import main

main()
