"""Agents behind the OpenAI API: the run's endpoint, its calls as turns, `flexmarl serve`."""
