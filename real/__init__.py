"""Real backend: the cluster interface on Ray, with vLLM or a small PyTorch engine and a PyTorch trainer."""
