from flowkit.cli import main

main()
