"""Models of the recipes, in plain PyTorch (imported only by the recipes that train them, on ranks):
torchvision's ResNets, whose parameter names they share so a torchvision state_dict loads, and a
nanoGPT-shaped decoder-only transformer."""
