from hvdtrain.cli import main

main()
