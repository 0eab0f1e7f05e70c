"""What a run leaves behind and who reads it: run.json's status and the run directories (runs),
`hvdtrain runs`' table and `show`'s curves (view), and MLflow (tracking)."""
