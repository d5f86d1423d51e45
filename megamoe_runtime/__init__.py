"""megamoe runtime: DeepGEMM MegaMoE layer, kernel-layout contract and numerics."""
