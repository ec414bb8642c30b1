from django.apps import AppConfig


class TaskflowConfig(AppConfig):
    name = "taskflow"
    verbose_name = "Taskflow"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.utils.module_loading import autodiscover_modules

        from .engine import ids, nodes

        # The id generator knows nothing of the database; its node numbers are leased here.
        ids.use_node_source(nodes.node_source())
        # Handlers live in each installed app's tasks.py, as with Django's own task modules.
        autodiscover_modules("tasks")
