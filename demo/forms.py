from django import forms

from .models import Document


class DocumentForm(forms.ModelForm):
    pages = forms.IntegerField(min_value=1, max_value=50, initial=5, help_text="each page takes the task 0.3 s")

    class Meta:
        model = Document
        fields = ["name", "pages"]


class WordCountForm(forms.Form):
    text = forms.CharField(widget=forms.Textarea(attrs={"rows": 4}), max_length=10_000)
