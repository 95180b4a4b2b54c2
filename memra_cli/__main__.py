from memra_cli.cli.app import main

main()
