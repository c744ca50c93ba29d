"""verl v0.8 compatibility: profiles in (verl-shaped configs -> our config), bundle out (export --verl)."""
