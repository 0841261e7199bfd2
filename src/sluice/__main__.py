from sluice.cli.app import main

main()
