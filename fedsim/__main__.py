from fedsim.cli import main

raise SystemExit(main())
