"""What people read: run reports, figures and comparisons across runs."""
