from benchmarks.soak.chaos import main

raise SystemExit(main())
