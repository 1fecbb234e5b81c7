from ipmasq.cli import main

raise SystemExit(main())
