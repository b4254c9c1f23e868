"""The LLM tasks of the PAI-2 QA pipeline: one module per task, each with its prompt, output model and parser."""

from services.qa.tasks.answer_check import AnswerCheckInput, AnswerCheckTask, Verdict
from services.qa.tasks.clue_query import ClueQueryInput, ClueQueryTask, Substitution, mention, substitute
from services.qa.tasks.combine import CombineInput, CombineTask
from services.qa.tasks.common import is_no_info
from services.qa.tasks.decompose import DecomposeInput, DecomposeTask
from services.qa.tasks.enhance import EnhanceInput, EnhanceTask
from services.qa.tasks.ner import NerInput, NerTask
from services.qa.tasks.plan import PlanInput, PlanTask
from services.qa.tasks.search_plan import PlannedStep, SearchPlan, SearchPlanInput, SearchPlanTask
from services.qa.tasks.sufficiency import SufficiencyInput, SufficiencyTask
from services.qa.tasks.summarise import ClueAnswerInput, ClueAnswerTask, Finding, StepAnswerInput, StepAnswerTask

__all__ = [
    "AnswerCheckInput",
    "AnswerCheckTask",
    "ClueAnswerInput",
    "ClueAnswerTask",
    "ClueQueryInput",
    "ClueQueryTask",
    "CombineInput",
    "CombineTask",
    "DecomposeInput",
    "DecomposeTask",
    "EnhanceInput",
    "EnhanceTask",
    "Finding",
    "NerInput",
    "NerTask",
    "PlanInput",
    "PlanTask",
    "PlannedStep",
    "SearchPlan",
    "SearchPlanInput",
    "SearchPlanTask",
    "StepAnswerInput",
    "StepAnswerTask",
    "Substitution",
    "SufficiencyInput",
    "SufficiencyTask",
    "Verdict",
    "is_no_info",
    "mention",
    "substitute",
]
